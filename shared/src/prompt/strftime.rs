//! `strftime_now(format)`, the function transformers gives chat templates: Python's
//! `datetime.now().strftime(format)` in the C locale. Llama 3.x prints "Today Date" with it and
//! gpt-oss "Current date", so the first block of every such prompt depends on the date.
//!
//! Time-zone rule: kvgate formats the time in **UTC**. vLLM's process formats its local time,
//! which is UTC in the engine images unless `TZ` is set; engines run with another `TZ` differ
//! from kvgate around midnight in that zone (those prompts miss their first block).
//!
//! The specifiers are C's that templates use, plus glibc's `-` flag (no padding, `%-d`); any
//! other is an error (the template fails, and the request is routed on an estimate).

use std::fmt::Write as _;

/// A civil date and time in UTC, from seconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday.
    weekday: u32,
    /// 1-based.
    day_of_year: u32,
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (i64::from(month) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

impl Civil {
    fn from_unix(secs: i64) -> Civil {
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        Civil {
            year,
            month,
            day,
            hour: (rem / 3_600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            weekday: (days + 4).rem_euclid(7) as u32,
            day_of_year: (days - days_from_civil(year, 1, 1) + 1) as u32,
        }
    }
}

const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
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

/// `format` at `unix_secs` (UTC), as Python's `strftime` in the C locale; an unknown
/// specifier is an error naming it.
pub fn strftime(format: &str, unix_secs: i64) -> Result<String, String> {
    let t = Civil::from_unix(unix_secs);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let (pad, spec) = match chars.next() {
            Some('-') => (false, chars.next()),
            other => (true, other),
        };
        let num = |out: &mut String, n: u32, width: usize| {
            let _ = if pad { write!(out, "{n:0width$}") } else { write!(out, "{n}") };
        };
        match spec {
            Some('Y') => {
                let _ = write!(out, "{}", t.year);
            }
            Some('y') => num(&mut out, t.year.rem_euclid(100) as u32, 2),
            Some('m') => num(&mut out, t.month, 2),
            Some('d') => num(&mut out, t.day, 2),
            Some('e') => {
                let _ = if pad { write!(out, "{:>2}", t.day) } else { write!(out, "{}", t.day) };
            }
            Some('j') => num(&mut out, t.day_of_year, 3),
            Some('H') => num(&mut out, t.hour, 2),
            Some('I') => num(&mut out, (t.hour + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, t.minute, 2),
            Some('S') => num(&mut out, t.second, 2),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('a') => out.push_str(&DAYS[t.weekday as usize][..3]),
            Some('A') => out.push_str(DAYS[t.weekday as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[t.month as usize - 1]),
            Some('F') => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: unsupported specifier %{other}")),
            None => return Err("strftime_now: the format ends in %".into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected strings are what CPython 3.11 prints for the same instants
    /// (`datetime.fromtimestamp(t, timezone.utc).strftime(f)`).
    #[test]
    fn formats_as_python_does() {
        let jul_26_2024_0930 = 1_721_986_200; // Friday
        assert_eq!(strftime("%d %b %Y", jul_26_2024_0930).unwrap(), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d", jul_26_2024_0930).unwrap(), "2024-07-26");
        assert_eq!(
            strftime("%A, %B %-d %I:%M:%S %p (%j, %y) %%", jul_26_2024_0930).unwrap(),
            "Friday, July 26 09:30:00 AM (208, 24) %"
        );
        let leap = 1_709_208_000; // 2024-02-29 12:00:00 UTC, Thursday
        assert_eq!(strftime("%a %e %h %F %H", leap).unwrap(), "Thu 29 Feb 2024-02-29 12");
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        assert_eq!(strftime("%-m/%e/%Y", 946_684_799).unwrap(), "12/31/1999");
        assert_eq!(strftime("%d %b %Y", -86_400).unwrap(), "31 Dec 1969");
    }

    #[test]
    fn every_day_of_four_centuries_round_trips() {
        for days in (-146_097..146_097 * 2).step_by(7) {
            let t = Civil::from_unix(days * 86_400);
            assert_eq!(days_from_civil(t.year, t.month, t.day), days);
            assert!((1..=366).contains(&t.day_of_year));
        }
    }

    #[test]
    fn unknown_specifiers_are_errors() {
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
        assert!(strftime("100%", 0).is_err());
    }
}
