//! Parsers for the literal values the attribute takes: durations, dates, sizes and the two enums.
//!
//! They only read text; range rules (> 0, ≤ 366d, ...) and the option names in messages belong to
//! `config.rs`. Each parser recognises the plausible near-misses (`"24 hours"`, `"1.5h"`,
//! `"2027/03/01"`, `"1MB"`, `"Reject"`) so that the error can say what was probably meant.

/// Milliseconds per unit, in canonical spelling.
const MS: u64 = 1;
const SEC: u64 = 1000;
const MIN: u64 = 60 * SEC;
const HOUR: u64 = 60 * MIN;
const DAY: u64 = 24 * HOUR;

/// Why a duration literal was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadDuration {
    /// Not recognisable as a duration at all.
    Unrecognized,
    /// Recognisable, but not in canonical form: the canonical spelling of the same duration.
    DidYouMean(String),
    /// Recognisable but not expressible; the explanation.
    Note(String),
    /// Does not fit in 64-bit milliseconds.
    TooLarge,
}

/// Parses `"<n><unit>"` (units `s`, `m`, `h`, `d`, and `ms` when `allow_ms`) into milliseconds.
///
/// Only the canonical form is accepted: one whole number, one lower-case unit, no spaces. Anything
/// else that still reads as a duration (`"24 hours"`, `"1h30m"`, `"1.5h"`, `"2w"`) comes back as
/// [`BadDuration::DidYouMean`] with the canonical spelling.
pub(crate) fn parse_duration(text: &str, allow_ms: bool) -> Result<u64, BadDuration> {
    if let Some((n, unit)) = canonical_split(text) {
        let per = match unit {
            "s" => SEC,
            "m" => MIN,
            "h" => HOUR,
            "d" => DAY,
            "ms" if allow_ms => MS,
            _ => 0,
        };
        if per != 0 {
            return n.checked_mul(per).ok_or(BadDuration::TooLarge);
        }
    }
    Err(explain_duration(text, allow_ms))
}

/// `"24h"` → `(24, "h")`: digits then ASCII lower-case letters, nothing else.
fn canonical_split(text: &str) -> Option<(u64, &str)> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (n, unit) = text.split_at(digits);
    if n.is_empty() || unit.is_empty() || !unit.bytes().all(|b| b.is_ascii_lowercase()) {
        return None;
    }
    Some((n.parse().ok()?, unit))
}

/// Works out what a non-canonical duration probably meant.
fn explain_duration(text: &str, allow_ms: bool) -> BadDuration {
    let t = text.trim();
    if t.is_empty() {
        return BadDuration::Unrecognized;
    }
    if t.starts_with('-') {
        return BadDuration::Note("durations cannot be negative".into());
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return BadDuration::Note(format!(
            "add a unit, e.g. \"{t}s\" (seconds), \"{t}m\", \"{t}h\" or \"{t}d\""
        ));
    }
    // Segments of number + unit word, e.g. "1h 30m", "24 hours", "1.5 h".
    let mut total_ms: u128 = 0;
    let mut rest = t;
    let mut segments = 0;
    // One whole number with a recognised unit: suggest the same number in the canonical unit.
    let mut same_unit: Option<String> = None;
    while !rest.is_empty() {
        let num_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        if num_len == 0 {
            return BadDuration::Unrecognized;
        }
        let (num, after) = rest.split_at(num_len);
        let after = after.trim_start();
        let unit_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphabetic())
            .count();
        let (unit, after) = after.split_at(unit_len);
        rest = after.trim_start_matches([' ', ',']);
        rest = rest.strip_prefix("and ").unwrap_or(rest);
        let (per, canonical) = match unit_ms(unit) {
            Ok(found) => found,
            Err(note) => return note,
        };
        same_unit = match canonical {
            Some(u) if segments == 0 && num.bytes().all(|b| b.is_ascii_digit()) => {
                Some(format!("{}{u}", num.trim_start_matches('0').max("0")))
            }
            _ => None,
        };
        let Some(ms) = decimal_times(num, per) else {
            return BadDuration::Unrecognized;
        };
        // Each segment fits u128 but their sum need not (found by fuzz/macro_values).
        let Some(sum) = total_ms.checked_add(ms) else {
            return BadDuration::TooLarge;
        };
        total_ms = sum;
        segments += 1;
    }
    if segments == 0 {
        return BadDuration::Unrecognized;
    }
    let Ok(total) = u64::try_from(total_ms) else {
        return BadDuration::TooLarge;
    };
    if !allow_ms && total % SEC != 0 {
        return BadDuration::Note("this option takes whole seconds (units s, m, h, d)".into());
    }
    match same_unit {
        Some(s) if segments == 1 && (allow_ms || !s.ends_with("ms")) => BadDuration::DidYouMean(s),
        _ => BadDuration::DidYouMean(format_ms(total)),
    }
}

/// The length of a unit word in ms and its canonical spelling (if it has one), or why it is not
/// accepted.
fn unit_ms(unit: &str) -> Result<(u128, Option<&'static str>), BadDuration> {
    let lower = unit.to_ascii_lowercase();
    Ok(match lower.as_str() {
        "ms" | "msec" | "msecs" | "milli" | "millis" | "millisecond" | "milliseconds" => {
            (1, Some("ms"))
        }
        "s" | "sec" | "secs" | "second" | "seconds" => (SEC.into(), Some("s")),
        "m" if unit == "M" => {
            return Err(BadDuration::Note(
                "`M` is not a unit: write minutes as \"m\", or months in days (\"30d\")".into(),
            ))
        }
        "m" | "min" | "mins" | "minute" | "minutes" => (MIN.into(), Some("m")),
        "h" | "hr" | "hrs" | "hour" | "hours" => (HOUR.into(), Some("h")),
        "d" | "day" | "days" => (DAY.into(), Some("d")),
        "w" | "wk" | "wks" | "week" | "weeks" => ((7 * DAY).into(), None),
        "mo" | "mon" | "month" | "months" | "y" | "yr" | "yrs" | "year" | "years" => {
            return Err(BadDuration::Note(
                "months and years vary in length: write days, e.g. \"30d\" or \"365d\"".into(),
            ))
        }
        "" => {
            return Err(BadDuration::Note(
                "every number needs a unit: s, m, h or d".into(),
            ))
        }
        _ => return Err(BadDuration::Unrecognized),
    })
}

/// `"1.5"` × `per` in whole units, if exact.
fn decimal_times(num: &str, per: u128) -> Option<u128> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 9 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let scale = 10u128.pow(frac.len() as u32);
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let scaled = frac.checked_mul(per)?;
    if scaled % scale != 0 {
        return None;
    }
    int.checked_mul(per)?.checked_add(scaled / scale)
}

/// Milliseconds in the largest unit that divides them: 5_400_000 → `"90m"`.
pub(crate) fn format_ms(ms: u64) -> String {
    for (per, unit) in [(DAY, "d"), (HOUR, "h"), (MIN, "m"), (SEC, "s")] {
        if ms != 0 && ms % per == 0 {
            return format!("{}{unit}", ms / per);
        }
    }
    if ms == 0 {
        "0s".into()
    } else {
        format!("{ms}ms")
    }
}

/// Why a date literal was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadDate {
    /// Not recognisable as a date.
    Unrecognized,
    /// The same date, written `YYYY-MM-DD`.
    DidYouMean(String),
    /// Recognisable but wrong; the explanation.
    Note(String),
}

/// Parses `"YYYY-MM-DD"` (a real calendar date, years 1970–9999) into the milliseconds since the
/// Unix epoch of its midnight UTC.
pub(crate) fn parse_date(text: &str) -> Result<i64, BadDate> {
    let b = text.as_bytes();
    let canonical = b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && b.iter()
            .enumerate()
            .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit());
    if !canonical {
        return Err(explain_date(text));
    }
    let year: i64 = text[0..4].parse().map_err(|_| BadDate::Unrecognized)?;
    let month: u32 = text[5..7].parse().map_err(|_| BadDate::Unrecognized)?;
    let day: u32 = text[8..10].parse().map_err(|_| BadDate::Unrecognized)?;
    check_calendar(year, month, day)?;
    Ok(days_from_civil(year, month, day) * 86_400_000)
}

fn explain_date(text: &str) -> BadDate {
    let t = text.trim();
    // An RFC 3339 timestamp: keep the date.
    if let Some((date, _time)) = t.split_once(['T', ' ']) {
        if parse_date(date).is_ok() {
            return BadDate::Note(format!(
                "only the date is taken (rejection starts at its midnight UTC): write \"{date}\""
            ));
        }
    }
    let parts: Vec<&str> = t.split(['-', '/', '.']).collect();
    let numeric = |p: &&str| !p.is_empty() && p.len() <= 4 && p.bytes().all(|c| c.is_ascii_digit());
    if parts.len() != 3 || !parts.iter().all(numeric) {
        return BadDate::Unrecognized;
    }
    if parts[0].len() == 4 {
        let (Ok(year), Ok(month), Ok(day)) = (
            parts[0].parse::<i64>(),
            parts[1].parse::<u32>(),
            parts[2].parse::<u32>(),
        ) else {
            return BadDate::Unrecognized;
        };
        if let Err(e) = check_calendar(year, month, day) {
            return e;
        }
        return BadDate::DidYouMean(format!("{year:04}-{month:02}-{day:02}"));
    }
    if parts[2].len() == 4 {
        return BadDate::Note(
            "day-month-year and month-day-year are ambiguous: write the year first, YYYY-MM-DD"
                .into(),
        );
    }
    BadDate::Unrecognized
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn check_calendar(year: i64, month: u32, day: u32) -> Result<(), BadDate> {
    if !(1970..=9999).contains(&year) {
        return Err(BadDate::Note(
            "the year must be between 1970 and 9999".into(),
        ));
    }
    if !(1..=12).contains(&month) {
        return Err(BadDate::Note(format!(
            "there is no month {month}: months run from 01 to 12"
        )));
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    if day == 0 || day > days {
        return Err(BadDate::Note(format!(
            "{} {year} has {days} days",
            MONTHS[month as usize - 1]
        )));
    }
    Ok(())
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Why a size literal was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadSize {
    /// Not recognisable as a size.
    Unrecognized,
    /// Recognisable; the explanation and the probable canonical spelling.
    Note(String),
    /// Does not fit.
    TooLarge,
}

/// Parses `"<n><unit>"` with units `B`, `KiB`, `MiB`, `GiB` into bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, BadSize> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (n, unit) = text.split_at(digits);
    let per: u64 = match unit {
        "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            let t = unit.trim();
            let binary = match t.to_ascii_lowercase().as_str() {
                "kb" | "k" | "kib" | "kbytes" => Some("KiB"),
                "mb" | "m" | "mib" | "mbytes" => Some("MiB"),
                "gb" | "g" | "gib" | "gbytes" => Some("GiB"),
                "b" | "" | "byte" | "bytes" => Some("B"),
                _ => None,
            };
            return Err(match binary {
                Some(u) if !n.is_empty() => BadSize::Note(format!(
                    "write \"{n}{u}\" (units B, KiB, MiB, GiB; 1 KiB = 1024 bytes)"
                )),
                _ => BadSize::Unrecognized,
            });
        }
    };
    let n: u64 = n.parse().map_err(|_| BadSize::Unrecognized)?;
    n.checked_mul(per).ok_or(BadSize::TooLarge)
}

/// `missing_key` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MissingKey {
    Reject,
    Pass,
    Derive,
}

/// `replay` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replay {
    Full,
    Minimal,
}

/// An enum value, or the probable intended value (if any) for the message.
pub(crate) fn parse_missing_key(text: &str) -> Result<MissingKey, Option<&'static str>> {
    match text {
        "reject" => Ok(MissingKey::Reject),
        "pass" => Ok(MissingKey::Pass),
        "derive" => Ok(MissingKey::Derive),
        _ => Err(
            match text
                .trim()
                .to_ascii_lowercase()
                .replace(['_', '-'], " ")
                .as_str()
            {
                "reject" | "required" | "require" | "deny" | "error" | "400" => Some("reject"),
                "pass" | "allow" | "optional" | "ignore" | "skip" | "passthrough"
                | "pass through" => Some("pass"),
                "derive" | "derived" | "auto" | "generate" | "fingerprint" => Some("derive"),
                other => closest(other, &["reject", "pass", "derive"]),
            },
        ),
    }
}

/// A replay mode, or the probable intended value (if any) for the message.
pub(crate) fn parse_replay(text: &str) -> Result<Replay, Option<&'static str>> {
    match text {
        "full" => Ok(Replay::Full),
        "minimal" => Ok(Replay::Minimal),
        _ => Err(match text.trim().to_ascii_lowercase().as_str() {
            "full" | "all" | "complete" | "body" | "everything" => Some("full"),
            "minimal" | "min" | "minimum" | "short" | "status" | "location" | "id" => {
                Some("minimal")
            }
            other => closest(other, &["full", "minimal"]),
        }),
    }
}

/// The candidate within edit distance 2 (and less than the word's length) of `word`, if any.
pub(crate) fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, _)| *d <= 2 && *d < word.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(text: &str) -> BadDuration {
        parse_duration(text, false).unwrap_err()
    }

    #[test]
    fn canonical_durations_parse_to_milliseconds() {
        assert_eq!(parse_duration("10s", false), Ok(10_000));
        assert_eq!(parse_duration("5m", false), Ok(300_000));
        assert_eq!(parse_duration("24h", false), Ok(86_400_000));
        assert_eq!(parse_duration("7d", false), Ok(604_800_000));
        assert_eq!(parse_duration("0s", false), Ok(0));
        assert_eq!(parse_duration("250ms", true), Ok(250));
    }

    #[test]
    fn segments_too_large_together_are_too_large_not_a_panic() {
        let max = u128::MAX;
        assert_eq!(
            parse_duration(&format!("{max}ms {max}ms"), true),
            Err(BadDuration::TooLarge)
        );
        assert_eq!(
            parse_duration(&format!("{max}ms 1s"), false),
            Err(BadDuration::TooLarge)
        );
    }

    #[test]
    fn milliseconds_only_where_allowed() {
        assert_eq!(
            parse_duration("250ms", false),
            Err(BadDuration::Note(
                "this option takes whole seconds (units s, m, h, d)".into()
            ))
        );
        assert_eq!(
            parse_duration("2000ms", false),
            Err(BadDuration::DidYouMean("2s".into()))
        );
    }

    #[test]
    fn near_misses_suggest_the_canonical_spelling() {
        let did = |s: &str| BadDuration::DidYouMean(s.into());
        assert_eq!(hint("24 hours"), did("24h"));
        assert_eq!(hint("24hours"), did("24h"));
        assert_eq!(hint("24H"), did("24h"));
        assert_eq!(hint("1 day"), did("1d"));
        assert_eq!(hint("30 secs"), did("30s"));
        assert_eq!(hint("10min"), did("10m"));
        assert_eq!(hint("1h30m"), did("90m"));
        assert_eq!(hint("1h 30m"), did("90m"));
        assert_eq!(hint("1.5h"), did("90m"));
        assert_eq!(hint("2w"), did("14d"));
        assert_eq!(hint(" 24h "), did("24h"));
        assert_eq!(hint("48 hours"), did("48h"));
    }

    #[test]
    fn nonsense_and_unit_less_durations_are_explained() {
        assert_eq!(hint("soon"), BadDuration::Unrecognized);
        assert_eq!(hint(""), BadDuration::Unrecognized);
        assert_eq!(hint("24x"), BadDuration::Unrecognized);
        assert!(matches!(hint("24"), BadDuration::Note(n) if n.contains("\"24h\"")));
        assert!(matches!(hint("-5s"), BadDuration::Note(n) if n.contains("negative")));
        assert!(matches!(hint("1M"), BadDuration::Note(n) if n.contains("30d")));
        assert!(matches!(hint("1 month"), BadDuration::Note(n) if n.contains("30d")));
        assert_eq!(
            parse_duration("99999999999999999999d", false),
            Err(BadDuration::TooLarge)
        );
        assert_eq!(
            parse_duration("999999999999999d", false),
            Err(BadDuration::TooLarge)
        );
    }

    #[test]
    fn format_picks_the_largest_exact_unit() {
        assert_eq!(format_ms(86_400_000), "1d");
        assert_eq!(format_ms(90 * 60_000), "90m");
        assert_eq!(format_ms(1_500), "1500ms");
        assert_eq!(format_ms(0), "0s");
    }

    #[test]
    fn dates_are_midnight_utc_in_epoch_milliseconds() {
        assert_eq!(parse_date("1970-01-01"), Ok(0));
        assert_eq!(parse_date("1970-01-02"), Ok(86_400_000));
        // `date -u -d 2027-03-01 +%s` = 1803859200
        assert_eq!(parse_date("2027-03-01"), Ok(1_803_859_200_000));
        assert_eq!(parse_date("2000-02-29"), Ok(951_782_400_000));
        assert_eq!(parse_date("2024-12-31"), Ok(1_735_603_200_000));
    }

    #[test]
    fn impossible_dates_say_why() {
        let note = |s: &str| match parse_date(s) {
            Err(BadDate::Note(n)) => n,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(note("2027-02-29"), "February 2027 has 28 days");
        assert_eq!(note("2100-02-29"), "February 2100 has 28 days");
        assert!(parse_date("2028-02-29").is_ok());
        assert_eq!(note("2027-04-31"), "April 2027 has 30 days");
        assert!(note("2027-13-01").contains("no month 13"));
        assert!(note("2027-01-00").contains("31 days"));
        assert!(note("1969-12-31").contains("1970"));
    }

    #[test]
    fn other_date_spellings_get_the_canonical_one() {
        assert_eq!(
            parse_date("2027/03/01"),
            Err(BadDate::DidYouMean("2027-03-01".into()))
        );
        assert_eq!(
            parse_date("2027-3-1"),
            Err(BadDate::DidYouMean("2027-03-01".into()))
        );
        assert!(
            matches!(parse_date("01/03/2027"), Err(BadDate::Note(n)) if n.contains("YYYY-MM-DD"))
        );
        assert!(
            matches!(parse_date("2027-03-01T00:00:00Z"), Err(BadDate::Note(n)) if n.contains("\"2027-03-01\""))
        );
        assert_eq!(parse_date("next march"), Err(BadDate::Unrecognized));
        assert_eq!(parse_date(""), Err(BadDate::Unrecognized));
    }

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("100B"), Ok(100));
        assert!(matches!(parse_size("1MB"), Err(BadSize::Note(n)) if n.contains("\"1MiB\"")));
        assert!(matches!(parse_size("64 kb"), Err(BadSize::Note(n)) if n.contains("\"64KiB\"")));
        assert!(matches!(parse_size("4096"), Err(BadSize::Note(n)) if n.contains("\"4096B\"")));
        assert_eq!(parse_size("big"), Err(BadSize::Unrecognized));
    }

    #[test]
    fn enum_values_and_their_hints() {
        assert_eq!(parse_missing_key("derive"), Ok(MissingKey::Derive));
        assert_eq!(parse_missing_key("Reject"), Err(Some("reject")));
        assert_eq!(parse_missing_key("optional"), Err(Some("pass")));
        assert_eq!(parse_missing_key("derrive"), Err(Some("derive")));
        assert_eq!(parse_missing_key("banana"), Err(None));
        assert_eq!(parse_replay("minimal"), Ok(Replay::Minimal));
        assert_eq!(parse_replay("minimum"), Err(Some("minimal")));
        assert_eq!(parse_replay("ful"), Err(Some("full")));
    }

    #[test]
    fn closest_ignores_distant_words() {
        assert_eq!(closest("tll", &["ttl", "scope"]), Some("ttl"));
        assert_eq!(closest("x", &["ttl"]), None);
    }
}
