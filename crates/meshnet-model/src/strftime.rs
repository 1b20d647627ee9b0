//! C's `strftime` for a UTC moment, for the `strftime_now(fmt)` chat templates call: the
//! directives dates are written with (`%Y %m %d %B %b %A %a %H %M %S %I %p %y %j %e %%`).
//! Other directives are copied through as written.

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
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC calendar moment.
struct Moment {
    year: i64,
    /// 1..=12.
    month: usize,
    /// 1..=31.
    day: i64,
    /// 0 = Monday.
    weekday: usize,
    /// 1..=366.
    day_of_year: i64,
    hour: i64,
    minute: i64,
    second: i64,
}

impl Moment {
    fn from_unix(seconds: i64) -> Self {
        let days = seconds.div_euclid(86_400);
        let in_day = seconds.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        let day_of_year = days - days_from_civil(year, 1, 1) + 1;
        Moment {
            year,
            month: month as usize,
            day,
            // 1970-01-01 was a Thursday.
            weekday: (days + 3).rem_euclid(7) as usize,
            day_of_year,
            hour: in_day / 3600,
            minute: in_day / 60 % 60,
            second: in_day % 60,
        }
    }
}

/// Year, month (1..=12) and day of the `days`-th day after 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to the given date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let shifted_month = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * shifted_month + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// `format` with its directives replaced by the parts of the UTC moment `unix_seconds`.
pub(crate) fn format(format: &str, unix_seconds: i64) -> String {
    let moment = Moment::from_unix(unix_seconds);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        match expand(&moment, directive) {
            Some(text) => out.push_str(&text),
            None => {
                out.push('%');
                out.push(directive);
            }
        }
    }
    out
}

fn expand(m: &Moment, directive: char) -> Option<String> {
    let month = MONTHS[m.month - 1];
    let weekday = WEEKDAYS[m.weekday];
    Some(match directive {
        'Y' => m.year.to_string(),
        'y' => format!("{:02}", m.year.rem_euclid(100)),
        'm' => format!("{:02}", m.month),
        'd' => format!("{:02}", m.day),
        'e' => format!("{:2}", m.day),
        'B' => month.to_owned(),
        'b' | 'h' => month[..3].to_owned(),
        'A' => weekday.to_owned(),
        'a' => weekday[..3].to_owned(),
        'H' => format!("{:02}", m.hour),
        'I' => format!("{:02}", (m.hour + 11) % 12 + 1),
        'p' => (if m.hour < 12 { "AM" } else { "PM" }).to_owned(),
        'M' => format!("{:02}", m.minute),
        'S' => format!("{:02}", m.second),
        'j' => format!("{:03}", m.day_of_year),
        '%' => "%".to_owned(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates_as_c_strftime() {
        // 2025-01-02T03:04:05Z, a Thursday.
        let t = 1_735_787_045;
        assert_eq!(format("%Y-%m-%d", t), "2025-01-02");
        assert_eq!(format("%d %b %Y", t), "02 Jan 2025");
        assert_eq!(format("%B %d, %Y", t), "January 02, 2025");
        assert_eq!(
            format("%A %a %H:%M:%S %I%p %j %y %e %%", t),
            "Thursday Thu 03:04:05 03AM 002 25  2 %"
        );
        assert_eq!(format("%Q and a trailing %", t), "%Q and a trailing %");
        // A leap day, and the day before the epoch.
        assert_eq!(
            format("%Y-%m-%d %A %j", 1_709_164_800),
            "2024-02-29 Thursday 060"
        );
        assert_eq!(format("%Y-%m-%d %A", -86_400), "1969-12-31 Wednesday");
    }
}
