//! When a certificate is valid: read from its DER (only the few fields
//! up to `validity`), so a server or client refuses an expired or garbled
//! certificate file when it starts, naming it, instead of every peer
//! failing its handshakes later.

/// One DER element at the start of `b`: (tag, contents, the rest).
fn element(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, b) = b.split_first()?;
    let (len, b) = if first < 0x80 {
        (first as usize, b)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        (b[..n].iter().fold(0usize, |a, &x| (a << 8) | x as usize), &b[n..])
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

const SEQUENCE: u8 = 0x30;

/// (notBefore, notAfter) of a certificate, in seconds since 1970.
fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (SEQUENCE, cert, _) = element(der)? else { return None };
    let (SEQUENCE, mut tbs, _) = element(cert)? else { return None };
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs)?.2; // version
    }
    let (_, _, rest) = element(tbs)?; // serial
    let (_, _, rest) = element(rest)?; // signature algorithm
    let (_, _, rest) = element(rest)?; // issuer
    let (SEQUENCE, times, _) = element(rest)? else { return None };
    let (t1, before, rest) = element(times)?;
    let (t2, after, _) = element(rest)?;
    Some((time(t1, before)?, time(t2, after)?))
}

/// A UTCTime (0x17) or GeneralizedTime (0x18), in UTC, as seconds since 1970.
fn time(tag: u8, s: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(s).ok()?.strip_suffix('Z')?;
    let (year, s) = match tag {
        0x17 => {
            let yy: i64 = s.get(..2)?.parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, s.get(2..)?)
        }
        0x18 => (s.get(..4)?.parse().ok()?, s.get(4..)?),
        _ => return None,
    };
    if s.len() != 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n = |i: usize| s[i..i + 2].parse::<i64>().ok();
    let (month, day, h, m, sec) = (n(0)?, n(2)?, n(4)?, n(6)?, n(8)?);
    Some(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + sec)
}

/// Days since 1970-01-01 of a date in the proleptic Gregorian calendar.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `secs` since 1970 as `YYYY-MM-DD`.
fn date(secs: i64) -> String {
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Whether `der` is a certificate valid now: else why not, in words.
pub(crate) fn check(der: &[u8]) -> Result<(), String> {
    let (before, after) = validity(der).ok_or("holds something that is not an X.509 certificate")?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    if now > after {
        return Err(format!("expired on {}", date(after)));
    }
    if now < before {
        return Err(format!("not valid before {}", date(before)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_through_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        for secs in [0, 951_782_400, 4_102_444_800, 1_700_000_000] {
            let s = date(secs);
            let (y, m, d) = (s[..4].parse().unwrap_or(0), s[5..7].parse().unwrap_or(0), s[8..].parse().unwrap_or(0));
            assert_eq!(days_from_civil(y, m, d), secs.div_euclid(86_400), "{s}");
        }
        assert_eq!(time(0x17, b"200101000000Z"), Some(days_from_civil(2020, 1, 1) * 86_400));
        assert_eq!(time(0x18, b"20491231235959Z"), Some(days_from_civil(2049, 12, 31) * 86_400 + 86_399));
        assert_eq!(time(0x17, b"2001010000Z"), None);
        assert_eq!(time(0x19, b"200101000000Z"), None);
    }

    #[test]
    fn garbage_is_not_a_certificate_and_does_not_panic() {
        for bad in [&[][..], &[0x30], &[0x30, 0x84, 0xff, 0xff, 0xff, 0xff], &[0x30, 0x02, 0x30, 0x00], b"hello"] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
    }
}
