//! Parsers for the literal values the attribute takes: durations, dates, sizes and the two enums.
//!
//! They only read text; range rules (> 0, ≤ 366d, ...) and the option names in messages belong to
//! `config.rs`. Each parser recognises the plausible near-misses (`"24 hours"`, `"1.5h"`,
//! `"2027/03/01"`, `"1MB"`, `"Reject"`) so that the error can say what was probably meant.
//!
//! No dependencies: `fuzz/fuzz_targets/macro_values.rs` compiles this file into itself.

/// Milliseconds per unit, in canonical spelling.
const MS: u64 = 1;
const SEC: u64 = 1000;
const MIN: u64 = 60 * SEC;
const HOUR: u64 = 60 * MIN;
const DAY: u64 = 24 * HOUR;

/// Why a literal was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Bad {
    /// Not recognisable at all.
    Unrecognized,
    /// Recognisable, but not in canonical form: the canonical spelling of the same value.
    DidYouMean(String),
    /// Recognisable but wrong or ambiguous; the explanation.
    Note(String),
    /// Does not fit in 64 bits.
    TooLarge,
}

/// Parses `"<n><unit>"` (units `s`, `m`, `h`, `d`, and `ms` when `allow_ms`) into milliseconds.
///
/// Only the canonical form is accepted: one whole number, one lower-case unit, no spaces. Anything
/// else that still reads as a duration (`"24 hours"`, `"1h30m"`, `"1.5h"`, `"2w"`) comes back as
/// [`Bad::DidYouMean`] with the canonical spelling.
pub(crate) fn parse_duration(text: &str, allow_ms: bool) -> Result<u64, Bad> {
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
            return n.checked_mul(per).ok_or(Bad::TooLarge);
        }
    }
    Err(explain_duration(text, allow_ms))
}

/// `"24h"` → `(24, "h")`: digits then ASCII lower-case letters, nothing else.
fn canonical_split(text: &str) -> Option<(u64, &str)> {
    let (n, unit) = split_while(text, |b| b.is_ascii_digit());
    if n.is_empty() || unit.is_empty() || !unit.bytes().all(|b| b.is_ascii_lowercase()) {
        return None;
    }
    Some((n.parse().ok()?, unit))
}

/// `text` cut after its longest prefix of ASCII bytes that pass `keep`.
fn split_while(text: &str, keep: impl Fn(u8) -> bool) -> (&str, &str) {
    text.split_at(text.bytes().take_while(|&b| keep(b)).count())
}

/// Works out what a non-canonical duration probably meant.
fn explain_duration(text: &str, allow_ms: bool) -> Bad {
    let t = text.trim();
    if t.is_empty() {
        return Bad::Unrecognized;
    }
    if t.starts_with('-') {
        return Bad::Note("durations cannot be negative".into());
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return Bad::Note(format!(
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
        let (num, after) = split_while(rest, |b| b.is_ascii_digit() || b == b'.');
        if num.is_empty() {
            return Bad::Unrecognized;
        }
        let (unit, after) = split_while(after.trim_start(), |b| b.is_ascii_alphabetic());
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
            return Bad::Unrecognized;
        };
        // Each segment fits u128 but their sum need not (found by fuzz/macro_values).
        let Some(sum) = total_ms.checked_add(ms) else {
            return Bad::TooLarge;
        };
        total_ms = sum;
        segments += 1;
    }
    let Ok(total) = u64::try_from(total_ms) else {
        return Bad::TooLarge;
    };
    if !allow_ms && total % SEC != 0 {
        return Bad::Note("this option takes whole seconds (units s, m, h, d)".into());
    }
    match same_unit {
        Some(s) if segments == 1 && (allow_ms || !s.ends_with("ms")) => Bad::DidYouMean(s),
        _ => Bad::DidYouMean(format_ms(total)),
    }
}

/// The length of a unit word in ms and its canonical spelling (if it has one), or why it is not
/// accepted.
fn unit_ms(unit: &str) -> Result<(u128, Option<&'static str>), Bad> {
    let lower = unit.to_ascii_lowercase();
    Ok(match lower.as_str() {
        "ms" | "msec" | "msecs" | "milli" | "millis" | "millisecond" | "milliseconds" => {
            (1, Some("ms"))
        }
        "s" | "sec" | "secs" | "second" | "seconds" => (SEC.into(), Some("s")),
        "m" if unit == "M" => {
            return Err(Bad::Note(
                "`M` is not a unit: write minutes as \"m\", or months in days (\"30d\")".into(),
            ))
        }
        "m" | "min" | "mins" | "minute" | "minutes" => (MIN.into(), Some("m")),
        "h" | "hr" | "hrs" | "hour" | "hours" => (HOUR.into(), Some("h")),
        "d" | "day" | "days" => (DAY.into(), Some("d")),
        "w" | "wk" | "wks" | "week" | "weeks" => ((7 * DAY).into(), None),
        "mo" | "mon" | "month" | "months" | "y" | "yr" | "yrs" | "year" | "years" => {
            return Err(Bad::Note(
                "months and years vary in length: write days, e.g. \"30d\" or \"365d\"".into(),
            ))
        }
        "" => return Err(Bad::Note("every number needs a unit: s, m, h or d".into())),
        _ => return Err(Bad::Unrecognized),
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
    // Digits only, at most nine: it parses, or is empty.
    let frac: u128 = frac.parse().unwrap_or(0);
    let scaled = frac.checked_mul(per)?;
    if scaled % scale != 0 {
        return None;
    }
    int.checked_mul(per)?.checked_add(scaled / scale)
}

/// Milliseconds in the largest unit that divides them: 5_400_000 → `"90m"`.
pub(crate) fn format_ms(ms: u64) -> String {
    let units = [(DAY, "d"), (HOUR, "h"), (MIN, "m"), (SEC, "s"), (MS, "ms")];
    match units.into_iter().find(|(per, _)| ms % per == 0 && ms != 0) {
        Some((per, unit)) => format!("{}{unit}", ms / per),
        None => "0s".into(),
    }
}

/// Parses `"YYYY-MM-DD"` (a real calendar date, years 1970–9999) into the milliseconds since the
/// Unix epoch of its midnight UTC.
pub(crate) fn parse_date(text: &str) -> Result<i64, Bad> {
    let t = text.trim();
    // An RFC 3339 timestamp: keep the date.
    if let Some((date, _time)) = t.split_once(['T', ' ']) {
        if parse_date(date).is_ok() {
            let note = "only the date is taken (rejection starts at its midnight UTC)";
            return Err(Bad::Note(format!("{note}: write \"{date}\"")));
        }
    }
    let parts: Vec<&str> = t.split(['-', '/', '.']).collect();
    let numeric = |p: &&str| !p.is_empty() && p.len() <= 4 && p.bytes().all(|c| c.is_ascii_digit());
    if parts.len() != 3 || !parts.iter().all(numeric) {
        return Err(Bad::Unrecognized);
    }
    if parts[0].len() != 4 {
        let ambiguous =
            "day-month-year and month-day-year are ambiguous: write the year first, YYYY-MM-DD";
        return Err(match parts[2].len() {
            4 => Bad::Note(ambiguous.into()),
            _ => Bad::Unrecognized,
        });
    }
    // At most four digits each: they parse.
    let [year, month, day] = [0, 1, 2].map(|i| parts[i].parse::<u32>().unwrap_or(0));
    let year = i64::from(year);
    check_calendar(year, month, day)?;
    let canonical = format!("{year:04}-{month:02}-{day:02}");
    if canonical != text {
        return Err(Bad::DidYouMean(canonical));
    }
    Ok(days_from_civil(year, month, day) * 86_400_000)
}

const MONTHS: &str =
    "January February March April May June July August September October November December";

fn check_calendar(year: i64, month: u32, day: u32) -> Result<(), Bad> {
    if !(1970..=9999).contains(&year) {
        return Err(Bad::Note("the year must be between 1970 and 9999".into()));
    }
    if !(1..=12).contains(&month) {
        return Err(Bad::Note(format!(
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
        let name = MONTHS.split(' ').nth(month as usize - 1);
        let name = name.unwrap_or_default();
        return Err(Bad::Note(format!("{name} {year} has {days} days")));
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

/// Parses `"<n><unit>"` with units `B`, `KiB`, `MiB`, `GiB` into bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, Bad> {
    let (n, unit) = split_while(text, |b| b.is_ascii_digit());
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
                Some(u) if !n.is_empty() => Bad::Note(format!(
                    "write \"{n}{u}\" (units B, KiB, MiB, GiB; 1 KiB = 1024 bytes)"
                )),
                _ => Bad::Unrecognized,
            });
        }
    };
    let n: u64 = n.parse().map_err(|_| Bad::Unrecognized)?;
    n.checked_mul(per).ok_or(Bad::TooLarge)
}

/// One value of an option that names a runtime enum's variant.
#[derive(Debug)]
pub(crate) struct Choice {
    /// As written in the attribute.
    pub(crate) value: &'static str,
    /// The runtime enum's variant.
    pub(crate) variant: &'static str,
    /// What it does, for messages.
    pub(crate) meaning: &'static str,
    /// Other words a user may write for it (compared lower-case, `_` and `-` as spaces).
    pub(crate) aliases: &'static [&'static str],
}

/// `value variant "meaning": aliases...;` rows, as [`Choice`]s.
macro_rules! choices {
    ($($value:literal $variant:ident $meaning:literal: $($alias:literal)*;)*) => {
        &[$(Choice { value: $value, variant: stringify!($variant), meaning: $meaning, aliases: &[$($alias),*] }),*]
    };
}

/// `missing_key`: `MissingKey`.
pub(crate) const MISSING_KEY: &[Choice] = choices! {
    "reject" Reject "answer 400": "required" "require" "deny" "error" "400";
    "pass" Pass "run unprotected": "allow" "optional" "ignore" "skip" "passthrough" "pass through";
    "derive" Derive "derive a key from the request": "derived" "auto" "generate" "fingerprint";
};

/// `replay`: `ReplayMode`.
pub(crate) const REPLAY: &[Choice] = choices! {
    "full" Full "status, headers and body": "all" "complete" "body" "everything";
    "minimal" Minimal "status, `Location` and the resource id": "min" "minimum" "short" "status" "location" "id";
};

/// `server_errors`: `ServerErrors`.
pub(crate) const SERVER_ERRORS: &[Choice] = choices! {
    "release" Release "not stored: a retry runs the handler again": "retry" "rerun" "forget" "drop" "discard" "released";
    "store" Store "stored and replayed like any other status": "keep" "cache" "replay" "save" "stored" "persist";
};

/// `client_errors`: `ClientErrors`.
pub(crate) const CLIENT_ERRORS: &[Choice] = choices! {
    "store" Store "stored and replayed: the client corrects its request under a new key": "keep" "cache" "replay" "save" "stored" "persist";
    "release" Release "not stored: the corrected retry with the same key runs": "retry" "rerun" "forget" "drop" "discard" "released";
};

/// The choice written `text`, or the probable intended one (if any) for the message.
pub(crate) fn parse_choice<'c>(
    text: &str,
    choices: &'c [Choice],
) -> Result<&'c Choice, Option<&'c str>> {
    if let Some(choice) = choices.iter().find(|c| c.value == text) {
        return Ok(choice);
    }
    let words = text.trim().to_ascii_lowercase().replace(['_', '-'], " ");
    let alias = choices
        .iter()
        .find(|c| c.value == words || c.aliases.contains(&words.as_str()));
    let values: Vec<&str> = choices.iter().map(|c| c.value).collect();
    Err(alias.map(|c| c.value).or_else(|| closest(&words, &values)))
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

    fn hint(text: &str) -> Bad {
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
            Err(Bad::TooLarge)
        );
        assert_eq!(
            parse_duration(&format!("{max}ms 1s"), false),
            Err(Bad::TooLarge)
        );
    }

    #[test]
    fn milliseconds_only_where_allowed() {
        assert_eq!(
            parse_duration("250ms", false),
            Err(Bad::Note(
                "this option takes whole seconds (units s, m, h, d)".into()
            ))
        );
        assert_eq!(
            parse_duration("2000ms", false),
            Err(Bad::DidYouMean("2s".into()))
        );
    }

    #[test]
    fn near_misses_suggest_the_canonical_spelling() {
        let did = |s: &str| Bad::DidYouMean(s.into());
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
        assert_eq!(hint("soon"), Bad::Unrecognized);
        assert_eq!(hint(""), Bad::Unrecognized);
        assert_eq!(hint("24x"), Bad::Unrecognized);
        assert!(matches!(hint("24"), Bad::Note(n) if n.contains("\"24h\"")));
        assert!(matches!(hint("-5s"), Bad::Note(n) if n.contains("negative")));
        assert!(matches!(hint("1M"), Bad::Note(n) if n.contains("30d")));
        assert!(matches!(hint("1 month"), Bad::Note(n) if n.contains("30d")));
        assert_eq!(
            parse_duration("99999999999999999999d", false),
            Err(Bad::TooLarge)
        );
        assert_eq!(
            parse_duration("999999999999999d", false),
            Err(Bad::TooLarge)
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
            Err(Bad::Note(n)) => n,
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
            Err(Bad::DidYouMean("2027-03-01".into()))
        );
        assert_eq!(
            parse_date("2027-3-1"),
            Err(Bad::DidYouMean("2027-03-01".into()))
        );
        assert!(matches!(parse_date("01/03/2027"), Err(Bad::Note(n)) if n.contains("YYYY-MM-DD")));
        assert!(
            matches!(parse_date("2027-03-01T00:00:00Z"), Err(Bad::Note(n)) if n.contains("\"2027-03-01\""))
        );
        assert_eq!(parse_date("next march"), Err(Bad::Unrecognized));
        assert_eq!(parse_date(""), Err(Bad::Unrecognized));
    }

    #[test]
    fn sizes_use_binary_units() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("100B"), Ok(100));
        assert!(matches!(parse_size("1MB"), Err(Bad::Note(n)) if n.contains("\"1MiB\"")));
        assert!(matches!(parse_size("64 kb"), Err(Bad::Note(n)) if n.contains("\"64KiB\"")));
        assert!(matches!(parse_size("4096"), Err(Bad::Note(n)) if n.contains("\"4096B\"")));
        assert_eq!(parse_size("big"), Err(Bad::Unrecognized));
    }

    #[test]
    fn enum_values_and_their_hints() {
        let variant = |text, choices| parse_choice(text, choices).map(|c| c.variant);
        assert_eq!(variant("derive", MISSING_KEY), Ok("Derive"));
        assert_eq!(variant("Reject", MISSING_KEY), Err(Some("reject")));
        assert_eq!(variant("optional", MISSING_KEY), Err(Some("pass")));
        assert_eq!(variant("pass-through", MISSING_KEY), Err(Some("pass")));
        assert_eq!(variant("derrive", MISSING_KEY), Err(Some("derive")));
        assert_eq!(variant("banana", MISSING_KEY), Err(None));
        assert_eq!(variant("minimal", REPLAY), Ok("Minimal"));
        assert_eq!(variant("minimum", REPLAY), Err(Some("minimal")));
        assert_eq!(variant("ful", REPLAY), Err(Some("full")));
        assert_eq!(variant("store", SERVER_ERRORS), Ok("Store"));
        assert_eq!(variant("Stored", SERVER_ERRORS), Err(Some("store")));
        assert_eq!(variant("relase", SERVER_ERRORS), Err(Some("release")));
    }

    #[test]
    fn closest_ignores_distant_words() {
        assert_eq!(closest("tll", &["ttl", "scope"]), Some("ttl"));
        assert_eq!(closest("x", &["ttl"]), None);
    }
}
