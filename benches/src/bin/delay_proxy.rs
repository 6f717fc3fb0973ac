//! `delay_proxy LISTEN UPSTREAM ONE_WAY_US COUNT_FILE`: the testkit's
//! delaying, counting TCP proxy as a process of its own (for network
//! namespaces, where the bucket and its clients are different hosts).
//! Writes the bytes the upstream sent so far to COUNT_FILE every 100 ms
//! (atomically: a new file renamed over it);
//! runs until killed.

use arbor_engine::testkit::Proxy;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, upstream, one_way_us, count_file] = args.as_slice() else {
        eprintln!("usage: delay_proxy LISTEN UPSTREAM ONE_WAY_US COUNT_FILE");
        std::process::exit(2);
    };
    let (Ok(upstream), Ok(us)) = (upstream.parse(), one_way_us.parse::<u64>()) else {
        eprintln!("delay_proxy: UPSTREAM is HOST:PORT, ONE_WAY_US a number");
        std::process::exit(2);
    };
    let proxy = match Proxy::start_on(listen, upstream, Duration::from_micros(us)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("delay_proxy: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    // Written aside and renamed over: a reader never sees the file empty
    // or half written.
    let aside = format!("{count_file}.new");
    loop {
        if std::fs::write(&aside, format!("{}\n", proxy.sent())).is_ok() {
            let _ = std::fs::rename(&aside, count_file);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
