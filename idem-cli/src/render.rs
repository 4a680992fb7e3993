//! What each command prints: one JSON document with stable field names (`--json`), or a table for
//! people. Times are RFC 3339 in UTC with milliseconds; durations are whole milliseconds.

use idem_runtime::admin::{Forgotten, Inspection};
use idem_runtime::clock::Timestamp;
use idem_runtime::store::{Listed, StateKind, Stats};
use idem_runtime::RecordState;
use serde_json::{json, Value};
use std::time::Duration;

/// `idem inspect`.
pub(crate) fn inspection(as_json: bool, scope: &str, key: &str, found: Option<&Inspection>) {
    let Some(seen) = found else {
        if as_json {
            print_json(&json!({"found": false, "scope": scope, "key": key}));
        } else {
            println!("no record for key `{key}` in scope `{scope}`");
        }
        return;
    };
    let record = &seen.record;
    let lease_until = match record.state {
        RecordState::InFlight { lease_until } => Some(lease_until),
        _ => None,
    };
    let response = match &record.state {
        RecordState::Completed { response } => Some(response),
        _ => None,
    };
    if as_json {
        print_json(&json!({
            "found": true,
            "scope": seen.key.scope(),
            "key": seen.key.key(),
            "state": seen.state().as_str(),
            "expired": seen.expired(),
            "lease_live": seen.lease_live(),
            "created_at": time(record.created_at),
            "expires_at": time(record.expires_at),
            "retain_until": time(record.retain_until),
            "lease_until": lease_until.map(time),
            "now": time(seen.now),
            "token": record.token.0,
            "fingerprint": record.fingerprint.to_hex(),
            "response": response.map(|r| json!({
                "status": r.status,
                "headers": r.headers.iter().map(|(name, value)| json!([
                    name.as_str(),
                    String::from_utf8_lossy(value.as_bytes()),
                ])).collect::<Vec<_>>(),
                "body_bytes": r.body.len(),
            })),
        }));
        return;
    }
    let mut rows = vec![
        ("scope", seen.key.scope().to_owned()),
        ("key", seen.key.key().to_owned()),
        ("state", state_words(seen)),
        ("created", time(record.created_at)),
        ("expires", time(record.expires_at)),
        ("retained until", time(record.retain_until)),
    ];
    if let Some(lease_until) = lease_until {
        rows.push(("lease until", time(lease_until)));
    }
    rows.push(("store time", time(seen.now)));
    rows.push(("token", record.token.0.to_string()));
    rows.push(("fingerprint", record.fingerprint.to_hex()));
    if let Some(response) = response {
        rows.push(("status", response.status.to_string()));
        for (name, value) in &response.headers {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            rows.push(("header", format!("{name}: {value}")));
        }
        rows.push(("body", format!("{} bytes", response.body.len())));
    }
    print_rows(&rows);
}

fn state_words(seen: &Inspection) -> String {
    let state = seen.state().as_str().replace('_', " ");
    match (seen.expired(), seen.state()) {
        (true, _) => format!("{state}, expired (answers 410)"),
        (false, StateKind::InFlight) if seen.lease_live() => format!("{state}, lease live"),
        (false, StateKind::InFlight) => format!("{state}, lease run out (a retry takes it over)"),
        _ => state,
    }
}

/// `idem forget`.
pub(crate) fn forgotten(as_json: bool, scope: &str, key: &str, forgotten: Forgotten) {
    let (result, state, lease_live) = match forgotten {
        Forgotten::Deleted(state) => ("deleted", Some(state), None),
        Forgotten::NotFound => ("not_found", None, None),
        Forgotten::Refused { state, lease_live } => ("refused", Some(state), Some(lease_live)),
        Forgotten::Changed => ("changed", None, None),
    };
    if as_json {
        print_json(&json!({
            "result": result,
            "scope": scope,
            "key": key,
            "state": state.map(StateKind::as_str),
            "lease_live": lease_live,
        }));
        return;
    }
    match forgotten {
        Forgotten::Deleted(state) => println!(
            "forgot key `{key}` in scope `{scope}` (it was {}): its next request runs as new",
            state.as_str().replace('_', " ")
        ),
        Forgotten::NotFound => println!("no record for key `{key}` in scope `{scope}`"),
        Forgotten::Refused { state, lease_live } => println!(
            "not forgotten: key `{key}` in scope `{scope}` is {}{}; {}",
            state.as_str().replace('_', " "),
            if lease_live {
                " under a live lease"
            } else {
                ""
            },
            if lease_live {
                "its handler may be running: --force forgets it anyway (a retry then runs it again)"
            } else {
                "--dead-claims forgets a claim whose lease ran out"
            }
        ),
        Forgotten::Changed => {
            println!("not forgotten: the record changed while it was being forgotten; look again")
        }
    }
}

/// `idem erase`.
pub(crate) fn erased(as_json: bool, scope: &str, erased: u64) {
    if as_json {
        print_json(&json!({"scope": scope, "erased": erased}));
    } else {
        println!("erased {erased} record(s) of scope `{scope}`");
    }
}

/// `idem in-flight`.
pub(crate) fn in_flight(as_json: bool, older_than: Duration, listed: &[Listed], now: Timestamp) {
    let lease = |listed: &Listed| match listed.record.state {
        RecordState::InFlight { lease_until } => Some(lease_until),
        _ => None,
    };
    if as_json {
        let records: Vec<Value> = listed
            .iter()
            .map(|l| {
                json!({
                    "scope": l.key.scope(),
                    "key": l.key.key(),
                    "created_at": time(l.record.created_at),
                    "age_ms": millis(l.record.created_at.until(now)),
                    "lease_until": lease(l).map(time),
                    "lease_live": lease(l).is_some_and(|until| until > now),
                    "token": l.record.token.0,
                })
            })
            .collect();
        print_json(&json!({
            "now": time(now),
            "older_than_ms": millis(older_than),
            "records": records,
        }));
        return;
    }
    if listed.is_empty() {
        println!("no record in flight for {} or longer", age(older_than));
        return;
    }
    let mut table = vec![[
        "SCOPE".to_owned(),
        "KEY".to_owned(),
        "AGE".to_owned(),
        "LEASE".to_owned(),
        "CREATED".to_owned(),
    ]];
    for l in listed {
        let lease = match lease(l) {
            Some(until) if until > now => format!("live, {} left", age(now.until(until))),
            Some(_) => "run out".to_owned(),
            None => "-".to_owned(),
        };
        table.push([
            l.key.scope().to_owned(),
            l.key.key().to_owned(),
            age(l.record.created_at.until(now)),
            lease,
            time(l.record.created_at),
        ]);
    }
    print_table(&table);
}

/// `idem stats`.
pub(crate) fn stats(as_json: bool, kind: &str, stats: &Stats) {
    if as_json {
        print_json(&json!({
            "store": kind,
            "in_flight": stats.in_flight,
            "completed": stats.completed,
            "released": stats.released,
            "expired": stats.expired,
            "forgotten": stats.forgotten,
            "oldest_in_flight": stats.oldest_in_flight.map(time),
            "now": time(stats.now),
        }));
        return;
    }
    let mut rows = vec![
        ("store", kind.to_owned()),
        ("in flight", stats.in_flight.to_string()),
        ("completed", stats.completed.to_string()),
        ("released", stats.released.to_string()),
        ("expired (410)", stats.expired.to_string()),
        ("past retention", stats.forgotten.to_string()),
    ];
    if let Some(oldest) = stats.oldest_in_flight {
        rows.push(("oldest in flight", time(oldest)));
    }
    rows.push(("store time", time(stats.now)));
    print_rows(&rows);
}

fn print_json(value: &Value) {
    println!("{value:#}");
}

/// Name / value rows, names aligned.
fn print_rows(rows: &[(&str, String)]) {
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, value) in rows {
        println!("{name:<width$}  {value}");
    }
}

/// A table whose first row is the header.
fn print_table<const N: usize>(rows: &[[String; N]]) {
    let mut widths = [0; N];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// An age for people: `850ms`, `42s`, `7m 5s`, `3h 2m`, `2d 4h`.
fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.as_millis()),
        1..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// RFC 3339 in UTC with milliseconds: `2026-12-07T20:15:10.123Z`.
pub(crate) fn time(t: Timestamp) -> String {
    let ms = t.as_millis();
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s, milli) = (
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

/// The proleptic Gregorian date of a count of days since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::{age, time};
    use idem_runtime::clock::Timestamp;
    use std::time::Duration;

    #[test]
    fn times_are_rfc_3339_in_utc() {
        assert_eq!(time(Timestamp::from_millis(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            time(Timestamp::from_millis(1_795_996_800_123)),
            "2026-11-30T00:00:00.123Z"
        );
        assert_eq!(
            time(Timestamp::from_millis(951_782_400_000)),
            "2000-02-29T00:00:00.000Z"
        );
    }

    #[test]
    fn ages_read_as_people_say_them() {
        assert_eq!(age(Duration::from_millis(850)), "850ms");
        assert_eq!(age(Duration::from_secs(425)), "7m 5s");
        assert_eq!(age(Duration::from_secs(2 * 86_400 + 4 * 3600)), "2d 4h");
    }
}
