//! One operation, sent until the owner answers: backoff, looking the
//! owner up again, a timeout when one was given, and the tags that make
//! a request sent again apply at most once.

use super::*;

impl Inner {
    /// A lock request, asked again while the owner is in its lock grace
    /// period (bounded: the period ends), and the epoch of the owner that
    /// answered.
    pub(super) fn lock_call(&self, op: FileOp) -> Result<(Out, u64, u64)> {
        self.settle_all();
        let until = Instant::now() + MAX_LOCK_GRACE + Duration::from_secs(5);
        loop {
            // A fresh tag each round: a refusal (in grace, a conflict) is
            // kept as the answer to its tag.
            let tag = self.slots.take(self.client);
            let mut req = crate::branch::frames::Request::Op { session: 0, op: op.clone(), tag: Some(tag) };
            let mut epoch = 0;
            let answered = self.call_req(&mut req, None, &mut epoch);
            self.slots.give(tag);
            match answered {
                Err(e) if e.errno() == IN_GRACE && Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) if e.errno() == IN_GRACE => return Err(errno_error(libc::ENOLCK)),
                out => {
                    let session = match &req {
                        crate::branch::frames::Request::Op { session, .. } => *session,
                        _ => 0,
                    };
                    return out.map(|o| (o, epoch, session));
                }
            }
        }
    }

    /// Sends `op` until the owner answers it (or the timeout passes), once
    /// every write in flight has been answered.
    pub(super) fn call(&self, op: FileOp) -> Result<Out> {
        self.settle_all();
        self.call_raw(op)
    }

    /// [`Inner::call`] without waiting for the writes in flight.
    pub(super) fn call_raw(&self, op: FileOp) -> Result<Out> {
        self.call_back(op).0
    }

    /// [`Inner::call_raw`], giving the operation back (a write keeps its
    /// buffer). A change of the branch takes a slot for its tag.
    pub(super) fn call_back(&self, op: FileOp) -> (Result<Out>, FileOp) {
        let tag = op.once().then(|| self.slots.take(self.client));
        let out = self.call_tagged(op, tag, None);
        if let Some(tag) = tag {
            self.slots.give(tag);
        }
        out
    }

    /// Sends `op` as request `tag` until it is answered; with `bound`, only
    /// under that session (ESTALE once we have another).
    pub(super) fn call_tagged(&self, op: FileOp, tag: Option<RequestTag>, bound: Option<u64>) -> (Result<Out>, FileOp) {
        let ino = match &op {
            FileOp::Write { ino, .. } => Some(*ino),
            _ => None,
        };
        let mut req = crate::branch::frames::Request::Op { session: 0, op, tag };
        let touched = match (&req, ino) {
            (crate::branch::frames::Request::Op { op, .. }, None) => op.touches(),
            _ => Vec::new(),
        };
        let by = if touched.is_empty() { Who::default() } else { calling_process() };
        // Only changes of the branch are journaled until an fsync: opens and
        // locks are tagged too, but live in the session, not the branch.
        let changes = matches!(&req, crate::branch::frames::Request::Op { op, .. } if op.changes());
        let mut epoch = 0;
        let out = self.call_req(&mut req, bound, &mut epoch);
        if let (Ok(_), Some(tag), true) = (&out, tag, changes) {
            self.answered(tag, ino, touched, by, epoch);
        }
        match req {
            crate::branch::frames::Request::Op { op, .. } => (out, op),
            crate::branch::frames::Request::Session => (out, FileOp::StatFs),
        }
    }

    /// Notes request `tag` answered with success; a journal grown past
    /// [`JOURNAL_MAX`] is made durable at once.
    pub(super) fn answered(&self, tag: RequestTag, ino: Option<u64>, touched: Vec<u64>, by: Who, epoch: u64) {
        let over = {
            let mut j = self.journal.lock();
            j.answered(tag, ino, touched, by, epoch);
            j.len() > JOURNAL_MAX
        };
        if over {
            let upto = self.journal.lock().position();
            if self.call_raw(FileOp::Fsync { ino: arbor_engine::volume::ROOT_INO }).is_ok() {
                self.journal.lock().synced(upto);
            }
        }
    }

    /// Sends `req` until it is answered; `by` is set to the epoch of the
    /// owner that answered.
    pub(super) fn call_req(
        &self,
        req: &mut crate::branch::frames::Request,
        bound: Option<u64>,
        by: &mut u64,
    ) -> Result<Out> {
        let started = Instant::now();
        let mut backoff = BACKOFF_MIN;
        loop {
            let mut used = 0;
            let attempt = self.session().and_then(|s| {
                used = s.session;
                if bound.is_some_and(|b| b != s.session) {
                    return Ok(crate::branch::frames::Answer::Reply(Err(libc::ESTALE)));
                }
                *by = s.epoch;
                if let crate::branch::frames::Request::Op { session, op, tag } = req {
                    *session = s.session;
                    // Nor is a write sent again whose file's close gave up
                    // on it: reported lost there, it could now land over
                    // what another node wrote since.
                    if let (FileOp::Write { ino, .. }, Some(t)) = (&*op, *tag) {
                        if self.abandoned(*ino, t) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                    // A new session may have found the file gone: its
                    // number may name another file now.
                    // Nor does a write go to a file whose lock was lost with
                    // the session: it could land over what the lock's next
                    // holder wrote.
                    // A clone writes its destination, and reads a source
                    // whose number, too, may name another file now.
                    let written = match op {
                        FileOp::Write { ino, .. } => vec![*ino],
                        FileOp::CloneRange { src, dst, .. } => vec![*src, *dst],
                        _ => Vec::new(),
                    };
                    for ino in &written {
                        if self.journal.lock().gone.contains(ino) || self.locks.lock().writes_refused(*ino) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                    // Nor does a truncate.
                    if let FileOp::SetAttr { ino, change, .. } = op {
                        if change.size.is_some() && self.locks.lock().writes_refused(*ino) {
                            return Ok(crate::branch::frames::Answer::Reply(Err(libc::EIO)));
                        }
                    }
                }
                let sent = BootInstant::now();
                let answer = self.exchange(req);
                if let Ok(crate::branch::frames::Answer::Reply(_)) = &answer {
                    self.heard_at(sent);
                }
                answer
            });
            match attempt {
                Ok(crate::branch::frames::Answer::Reply(reply)) => {
                    if self.outage.swap(false, Ordering::Relaxed) {
                        self.locator.answered();
                        tracing::info!("the owner answers again");
                    }
                    return reply.map_err(errno_error);
                }
                Ok(crate::branch::frames::Answer::UnknownSession) => {
                    self.drop_session(used);
                }
                Ok(crate::branch::frames::Answer::Session(_)) => return Err(errno_error(libc::EPROTO)),
                Err(Failed::Refused) => {
                    tracing::warn!("the owner refused our token (check --token-file)");
                    return Err(errno_error(libc::EACCES));
                }
                Err(Failed::Session) => {
                    self.drop_session(used);
                }
                Err(Failed::Transport(e)) => {
                    if !self.outage.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "the owner cannot be reached; retrying");
                    }
                }
            }
            self.counts.retries.inc();
            if self.opts.timeout.is_some_and(|t| started.elapsed() >= t) {
                return Err(errno_error(libc::EIO));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }
}
