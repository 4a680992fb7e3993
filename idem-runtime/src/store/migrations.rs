//! idem's schema migrations as the [`Migrator`] `sqlx::migrate!` would build from them, with the SQL
//! embedded by `include_str!` in each store: idem then does not need sqlx's `macros` feature, whose
//! build-time dependencies every application would compile.

use sqlx::migrate::{Migration, MigrationType, Migrator};
use std::borrow::Cow;

/// One migration: its version, its description (the file name's words) and its SQL.
pub(crate) type Embedded = (i64, &'static str, &'static str);

/// A migrator over `files` that ignores versions it does not list: an application's own, recorded
/// in the same table, or a later idem's.
pub(crate) fn migrator(files: &[Embedded]) -> Migrator {
    let migrations = files.iter().map(|&(version, description, sql)| {
        let (description, sql) = (Cow::Borrowed(description), Cow::Borrowed(sql));
        Migration::new(version, description, MigrationType::Simple, sql, false)
    });
    Migrator {
        migrations: Cow::Owned(migrations.collect()),
        ignore_missing: true,
        ..Migrator::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use sqlx::migrate::{Migration, Migrator};

    /// Each store lists every file of its `migrations/` directory as `sqlx::migrate!` reads it:
    /// same versions, descriptions and checksums. A checksum that changed would stop every store
    /// already migrated; a file not listed would never run.
    fn same(ours: &Migrator, theirs: &Migrator) {
        let rows = |m: &Migrator| {
            m.iter()
                .map(|m: &Migration| (m.version, m.description.clone(), m.checksum.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(rows(ours), rows(theirs));
        assert!(ours.ignore_missing);
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_lists_what_sqlx_migrate_reads() {
        let ours = crate::store::sqlite::SqliteStore::migrator();
        same(&ours, &sqlx::migrate!("./migrations/sqlite"));
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_lists_what_sqlx_migrate_reads() {
        let ours = crate::store::postgres::migrator();
        same(&ours, &sqlx::migrate!("./migrations/postgres"));
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_lists_what_sqlx_migrate_reads() {
        let ours = crate::store::mysql::migrator();
        same(&ours, &sqlx::migrate!("./migrations/mysql"));
    }
}
