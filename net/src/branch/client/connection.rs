//! The client's connections to the owner: the HTTP/2 connection for
//! sessions and events, the pool of framed connections for operations,
//! dialling the owner found by the locator, and the session: opening it,
//! reconciling it with an owner that restarted (what it lost, which
//! files to open again, which locks to reclaim).

use super::*;

impl Inner {
    pub(super) async fn sender(&self) -> std::result::Result<(String, SendRequest<Full<Bytes>>), Failed> {
        let mut conn = self.conn.lock().await;
        if let Some((addr, s)) = conn.as_ref() {
            if !s.is_closed() {
                return Ok((addr.clone(), s.clone()));
            }
        }
        let locator = self.locator.clone();
        let addr = tokio::task::spawn_blocking(move || locator.owner())
            .await
            .ok()
            .flatten()
            .ok_or_else(|| Failed::Transport("no owner is recorded for the branch".into()))?;
        let send = connect(&addr, CONNECT_TIMEOUT, self.opts.tls.as_ref())
            .await
            .map_err(|e| Failed::Transport(format!("{addr}: {e}")))?;
        *conn = Some((addr.clone(), send.clone()));
        Ok((addr, send))
    }

    /// An HTTP GET of `/v1/files/<branch><path_and_query>` (the event poll).
    pub(super) async fn get(&self, path_and_query: &str) -> std::result::Result<Bytes, Failed> {
        let (addr, mut send) = self.sender().await?;
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("http://{addr}/v1/files/{}{path_and_query}", self.opts.branch))
            .header(AUTHORIZATION, self.auth.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| Failed::Transport(e.to_string()))?;
        let broke = |e: String| Failed::Transport(format!("{addr}: {e}"));
        let resp = match send.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                *self.conn.lock().await = None;
                return Err(broke(e.to_string()));
            }
        };
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| broke(e.to_string()))?.to_bytes();
        match status {
            StatusCode::OK => Ok(body),
            StatusCode::CONFLICT => Err(Failed::Session),
            StatusCode::UNAUTHORIZED => Err(Failed::Refused),
            s => {
                // 404: the branch is not (or no longer) served there; the
                // owner's record may name another process soon.
                *self.conn.lock().await = None;
                Err(broke(format!("{s} {}", String::from_utf8_lossy(&body).trim())))
            }
        }
    }

    /// A connection to the owner: an idle one, or a new one to the owner
    /// the pool knows, or to the owner found again.
    pub(super) fn take_conn(&self) -> std::result::Result<(String, Conn), Failed> {
        let known = {
            let mut pool = self.pool.lock();
            if let (Some(addr), Some(c)) = (pool.addr.clone(), pool.idle.pop()) {
                return Ok((addr, c));
            }
            pool.addr.clone()
        };
        let addr = match known {
            Some(a) => a,
            None => {
                self.locator.owner().ok_or_else(|| Failed::Transport("no owner is recorded for the branch".into()))?
            }
        };
        // An owner that no longer answers at the address we knew is looked
        // for again next time (the write lanes may hold every connection we
        // had to it, so no broken one in the pool says so).
        let conn = self.dial(&addr).inspect_err(|_| self.forget_owner())?;
        self.pool.lock().addr = Some(addr.clone());
        Ok((addr, conn))
    }

    /// A new framed connection to `addr`, past the hello.
    pub(super) fn dial(&self, addr: &str) -> std::result::Result<Conn, Failed> {
        use crate::wire::frames::{read_welcome, write_hello, Hello, Welcome, MAGIC, VERSION};
        use std::io::Write;
        let broke = |e: std::io::Error| Failed::Transport(format!("{addr}: {e}"));
        let stream = Stream::dial(addr, CONNECT_TIMEOUT, self.opts.tls.as_ref()).map_err(broke)?;
        stream.tcp().set_read_timeout(self.opts.timeout.or(Some(CONNECT_TIMEOUT))).map_err(broke)?;
        let mut c = Conn { stream, rbuf: Vec::new(), wbuf: Vec::new() };
        let hello =
            Hello { version: VERSION, token: self.opts.token.as_bytes().to_vec(), branch: self.opts.branch.clone() };
        c.stream.write_all(&MAGIC).map_err(broke)?;
        write_hello(&mut c.stream, &mut c.wbuf, &hello).map_err(broke)?;
        match read_welcome(&mut c.stream, &mut c.rbuf).map_err(broke)? {
            Welcome::Ok => {}
            Welcome::Refused => return Err(Failed::Refused),
            Welcome::NoBranch => {
                // The owner's record may name another process soon.
                self.forget_owner();
                return Err(Failed::Transport(format!("{addr}: the branch is not served there")));
            }
            Welcome::Version(v) => {
                return Err(Failed::Transport(format!("{addr}: the owner speaks protocol version {v}")))
            }
        }
        c.stream.tcp().set_read_timeout(self.read_timeout()).map_err(broke)?;
        Ok(c)
    }

    /// Drops every idle connection and the owner's address: the next
    /// operation looks for the owner again.
    pub(super) fn forget_owner(&self) {
        let mut pool = self.pool.lock();
        pool.addr = None;
        pool.idle.clear();
    }

    /// One request and its answer, on a connection of the pool.
    pub(super) fn exchange(
        &self,
        req: &crate::branch::frames::Request,
    ) -> std::result::Result<crate::branch::frames::Answer, Failed> {
        use crate::branch::frames::{read_answer, write_request, Request};
        let (addr, mut c) = self.take_conn()?;
        // A lock wait may take as long as the holder keeps the lock.
        let waits = matches!(req, Request::Op { op: FileOp::SetLk { wait: true, .. }, .. });
        let result = (|| {
            if waits {
                c.stream.tcp().set_read_timeout(None)?;
            }
            write_request(&mut c.stream, &mut c.wbuf, req)?;
            if !waits && self.opts.timeout.is_none() {
                self.await_answer(&mut c, &addr)?;
            }
            let a = read_answer(&mut c.stream, &mut c.rbuf)?;
            if waits {
                c.stream.tcp().set_read_timeout(self.read_timeout())?;
            }
            Ok::<_, std::io::Error>(a)
        })();
        match result {
            Ok(a) => {
                let mut pool = self.pool.lock();
                if pool.addr.as_deref() == Some(addr.as_str()) && pool.idle.len() < POOL_MAX {
                    pool.idle.push(c);
                }
                Ok(a)
            }
            Err(e) => {
                self.forget_owner();
                Err(Failed::Transport(format!("{addr}: {e}")))
            }
        }
    }

    /// Waits, on a hard mount, for the first byte of an answer, checking
    /// every [`OWNER_CHECK`] whether another owner was recorded meanwhile;
    /// if so, this one is given up (the request is sent again to the new
    /// owner, which applies a tagged request at most once).
    pub(super) fn await_answer(&self, c: &mut Conn, addr: &str) -> std::io::Result<()> {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        // Each turn ends with an answer, an error, or OWNER_CHECK spent.
        loop {
            match c.stream.wait_readable() {
                Ok(_) => break,
                Err(e) if matches!(e.kind(), TimedOut | WouldBlock) => {
                    if let Some(now) = (self.opts.locate)().filter(|now| now != addr) {
                        tracing::warn!(waited_on = addr, owner = %now, "the branch has a new owner; asking it instead");
                        return Err(std::io::Error::other("the owner was replaced while an answer was awaited"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A connection's read timeout: the mount's `--timeout`, or, on a hard
    /// mount, [`OWNER_CHECK`], after which [`Inner::await_answer`] looks
    /// for a new owner and waits on.
    pub(super) fn read_timeout(&self) -> Option<Duration> {
        self.opts.timeout.or(Some(OWNER_CHECK))
    }

    /// Our session, opened (and our open files opened again, our unsynced
    /// writes sent again if the owner restarted) if there is none.
    pub(super) fn session(&self) -> std::result::Result<SessionInfo, Failed> {
        if let Some(s) = *self.session.lock() {
            return Ok(s);
        }
        let _one = self.opening.lock();
        if let Some(s) = *self.session.lock() {
            return Ok(s);
        }
        // Before this exchange: when the old owner last answered us.
        let heard = *self.heard.lock();
        let had_session = self.epoch.lock().is_some();
        let info = match self.exchange(&crate::branch::frames::Request::Session)? {
            crate::branch::frames::Answer::Session(info) => info,
            _ => return Err(Failed::Transport("a garbled session answer".into())),
        };
        let restarted = self.epoch.lock().is_some_and(|e| e != info.epoch);
        if let Some(d) = &self.direct {
            d.forget_all();
        }
        if had_session {
            // A new owner, or the same one after our session expired: it is
            // asked which of our requests it has, and writes in flight under
            // the old session are never sent again (another node may have
            // written over them meanwhile).
            self.owner_changed.store(true, Ordering::Release);
            self.reconcile(info, restarted)?;
        } else {
            self.journal.lock().met(info.epoch);
        }
        // Locks first: a reclaim must reach the new owner within its grace
        // period, however many files there are to open again.
        if had_session {
            self.reclaim_locks(info, restarted, heard)?;
        } else {
            let mut l = self.locks.lock();
            l.epoch = info.epoch;
            l.session = info.session;
            l.generation = info.generation;
        }
        let reopen: Vec<(u64, OpenFile)> = self.open.lock().iter().map(|(&i, &f)| (i, f)).collect();
        for (ino, f) in reopen {
            match self.reopen(info.session, ino, f.count)? {
                Ok(Out::Attr(a)) if a.crtime == f.crtime => {}
                Ok(_) => {
                    // Another file got the number: ours is gone.
                    let _ = self.send(info.session, &FileOp::Release { ino })?;
                    self.lose(ino);
                }
                Err(errno) => {
                    tracing::warn!(ino, errno, "a file this mount had open is gone on the owner");
                    self.lose(ino);
                }
            }
        }
        if !self.counts.sessions.inc_is_first() {
            tracing::info!(session = format!("{:016x}", info.session), "a new session with the owner");
        }
        *self.epoch.lock() = Some(info.epoch);
        *self.session.lock() = Some(info);
        Ok(info)
    }

    /// Opens `ino` `count` times under `session`, at most
    /// [`MAX_OPEN_COUNT`] a request: what the last request gave, or the
    /// first refusal.
    pub(super) fn reopen(&self, session: u64, ino: u64, count: u32) -> std::result::Result<Reply, Failed> {
        let mut left = count.max(1);
        // Bounded: each round takes at least one open off `left`.
        loop {
            let n = left.min(MAX_OPEN_COUNT);
            let r = self.send(session, &FileOp::Open { ino, count: n })?;
            left -= n;
            if left == 0 || r.is_err() {
                return Ok(r);
            }
        }
    }

    /// One operation under `session`, not retried.
    pub(super) fn send(&self, session: u64, op: &FileOp) -> std::result::Result<Reply, Failed> {
        // The request owns its operation; the caller keeps its own.
        let req = crate::branch::frames::Request::Op { session, op: op.clone(), tag: None };
        match self.exchange(&req)? {
            crate::branch::frames::Answer::Reply(r) => Ok(r),
            crate::branch::frames::Answer::UnknownSession => Err(Failed::Session),
            crate::branch::frames::Answer::Session(_) => Err(Failed::Transport("a garbled reply".into())),
        }
    }

    /// Forgets open file `ino`: the owner no longer has it.
    pub(super) fn lose(&self, ino: u64) {
        self.open.lock().remove(&ino);
        self.journal.lock().forget_file(ino);
    }

    /// A new owner (epoch `info.epoch`): learns which of our answered
    /// requests it has, and marks the rest lost. Nothing is sent again.
    pub(super) fn reconcile(&self, info: SessionInfo, restarted: bool) -> std::result::Result<(), Failed> {
        let floors: HashMap<u32, u64> = match self.send(info.session, &FileOp::Slots { client: self.client })? {
            Ok(Out::Slots(v)) => v.into_iter().collect(),
            _ => return Err(Failed::Transport("a garbled answer about our requests".into())),
        };
        let lost = self.journal.lock().reconcile(&floors, info.epoch);
        if lost > 0 {
            tracing::error!(
                lost,
                "the owner changed and lost requests it had answered (not made durable); \
                 the next fsync of their files (of any file, for changes of names) fails with EIO"
            );
        } else if restarted {
            tracing::info!("the owner changed; it has every request this mount was answered");
        } else {
            tracing::info!("a new session with the same owner; it has every request this mount was answered");
        }
        *self.floors.lock() = (info.epoch, floors);
        Ok(())
    }

    /// Whether the owner of `epoch` had write `tag` when we met it.
    pub(super) fn owner_had(&self, epoch: u64, tag: RequestTag) -> bool {
        let floors = self.floors.lock();
        floors.0 == epoch && floors.1.get(&tag.slot).is_some_and(|&f| tag.seq <= f)
    }

    /// Forgets our session if it is still `used` (0: whatever it is): an
    /// answer about an older one must not drop a newer one.
    pub(super) fn drop_session(&self, used: u64) {
        let mut s = self.session.lock();
        if used == 0 || s.is_some_and(|c| c.session == used) {
            *s = None;
        }
    }

    /// The owner answered, under our session, a request sent at `sent`.
    pub(super) fn heard_at(&self, sent: BootInstant) {
        let mut h = self.heard.lock();
        if h.is_none_or(|t| t < sent) {
            *h = Some(sent);
        }
    }

    /// Takes back from a new owner (epoch changed: `restarted`) the locks
    /// this mount held, if the old owner cannot have dropped our session
    /// (`heard`: when the newest request it answered was sent, see
    /// [`crate::branch::locks`]); the rest are lost, and reported. After the same
    /// owner dropped our session, every lock is lost.
    /// The table stays locked throughout: a grant read meanwhile from the
    /// old owner is then seen to come from it, and refused.
    pub(super) fn reclaim_locks(
        &self,
        info: SessionInfo,
        restarted: bool,
        heard: Option<BootInstant>,
    ) -> std::result::Result<(), Failed> {
        let mut locks = self.locks.lock();
        let held = locks.all();
        let session = info.session;
        if held.is_empty() {
            locks.epoch = info.epoch;
            locks.session = info.session;
            locks.generation = info.generation;
            return Ok(());
        }
        let in_window = restarted
            && heard.is_some_and(|t| t.elapsed() < RECLAIM_WINDOW)
            && locks.generation != u64::MAX
            && info.generation == locks.generation + 1;
        let mut lost: Vec<(u64, u64)> = Vec::new();
        for (ino, owner, lock) in held {
            if lost.contains(&(ino, owner)) {
                continue;
            }
            let kept = in_window
                && self.send(session, &FileOp::SetLk { ino, owner, lock, wait: false, reclaim: true })?.is_ok();
            if !kept {
                lost.push((ino, owner));
            }
        }
        locks.epoch = info.epoch;
        locks.session = info.session;
        locks.generation = info.generation;
        if lost.is_empty() {
            tracing::info!("the owner changed; this mount took back every lock it held");
            return Ok(());
        }
        tracing::error!(
            lost = lost.len(),
            reclaimed_in_time = in_window,
            "locks this mount held were lost with the owner's session; \
             the next fsync of their files fails with EIO, the next lock request of their holders with ENOLCK"
        );
        let mut journal = self.journal.lock();
        for (ino, owner) in lost {
            locks.lose(ino, owner);
            journal.lost.insert(ino);
        }
        Ok(())
    }
}
