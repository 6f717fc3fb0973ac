//! Writes in flight: each sent on its file's lane without waiting for
//! the answer, settled before anything that must see them, and sent again
//! in order, with their tags, when a lane's connection breaks.

use super::*;

impl Inner {
    /// Sends a write on its lane without waiting for the answer: `false`
    /// if it could not be sent (the caller writes it the retrying way).
    /// The data is copied for resending while the owner works on it.
    pub(super) fn send_write(&self, at: Written, data: &[u8]) -> bool {
        let ino = at.ino;
        let mut lane = self.lanes[ino as usize % WRITE_LANES].lock();
        lane.idx = ino as usize % WRITE_LANES;
        while !lane.sent.is_empty()
            && (lane.conn.is_none() || lane.bytes + data.len() > IN_FLIGHT_MAX || lane.sent.len() >= IN_FLIGHT_WRITES)
        {
            self.settle_one(&mut lane);
        }
        let slot = PIPELINED_SLOT | (ino as usize % WRITE_LANES) as u32;
        let tag = RequestTag { client: self.client, slot, seq: lane.seq + 1 };
        let sent = self.session().ok().and_then(|session| {
            // Checked again under the session the write goes out on: setting
            // it up may have found the file's lock lost.
            if self.journal.lock().gone.contains(&ino) || self.locks.lock().writes_refused(ino) {
                return None;
            }
            if lane.conn.is_none() {
                let (addr, c) = self.take_conn().ok()?;
                if self.opts.timeout.is_none() {
                    // A paused owner's kernel still takes bytes, then stops:
                    // a hard mount checks for a successor (see read_one).
                    c.stream.tcp().set_write_timeout(Some(OWNER_CHECK)).ok()?;
                }
                *self.lane_socks[ino as usize % WRITE_LANES].lock() = c.stream.tcp().try_clone().ok();
                lane.addr = addr;
                lane.conn = Some(c);
            }
            let c = lane.conn.as_mut()?;
            crate::branch::frames::write_data(&mut c.stream, &mut c.wbuf, session.session, Some(tag), at, data).ok()?;
            Some((session.epoch, session.session))
        });
        let Some((epoch, session)) = sent else {
            // Part of it may have gone. The lane's earlier writes are sent
            // again, and the caller sends this one the retrying way after
            // them, so the owner sees them in order.
            if lane.conn.is_some() {
                self.drop_conn(&mut lane);
                self.forget_owner();
            }
            self.settle_lane(&mut lane);
            return false;
        };
        lane.seq = tag.seq;
        self.lane_seqs[ino as usize % WRITE_LANES].store(tag.seq, Ordering::Release);
        let data = Bytes::copy_from_slice(data);
        lane.bytes += data.len();
        lane.sent.push_back(Sent { tag, epoch, session, at, data });
        true
    }

    /// Reads the answers to every write in flight on every lane.
    pub(super) fn settle_all(&self) {
        for lane in &self.lanes {
            let mut lane = lane.lock();
            if !lane.sent.is_empty() {
                self.settle_lane(&mut lane);
            }
        }
    }

    /// Reads the answers to the writes in flight on `ino`'s lane while the
    /// owner answers; writes a broken connection carried stay in flight,
    /// for the next operation to send again. A `close` waits this way: it
    /// must not wait out an owner's absence, because a process that starts
    /// the next owner closes descriptors it inherited (every exec does) and
    /// would wait for itself. Whether no write to `ino` is left in flight;
    /// if some are, they are given up ([`Inner::abandon`]).
    pub(super) fn settle_reachable(&self, ino: u64) -> bool {
        let lane = &self.lanes[ino as usize % WRITE_LANES];
        // Bounded by the lane's holder: it sends or reads a few MiB, or is
        // retrying, which marks an outage.
        let mut lane = loop {
            if let Some(mut l) = lane.try_lock_for(Duration::from_millis(20)) {
                l.idx = ino as usize % WRITE_LANES;
                break l;
            }
            if self.outage.load(Ordering::Relaxed) {
                // Its holder is waiting for the owner (with writes in
                // flight, perhaps some of this file's).
                self.abandon(ino);
                return false;
            }
        };
        // Each turn answers one write or stops.
        while !lane.sent.is_empty() {
            if self.read_one(&mut lane).is_err() {
                self.drop_conn(&mut lane);
                if lane.sent.iter().any(|w| w.at.ino == ino) {
                    // Given up while the lane is held: no other thread can
                    // send them again in between.
                    self.abandon(ino);
                    return false;
                }
                return true;
            }
        }
        true
    }

    /// Drops `lane`'s connection, hanging it up (its handle in
    /// `lane_socks` would keep it open otherwise).
    pub(super) fn drop_conn(&self, lane: &mut Lane) {
        lane.conn = None;
        if let Some(s) = self.lane_socks[lane.idx].lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Gives up on the writes to `ino` in flight now, which a close could
    /// not have answered: reported lost (the close fails with EIO, and so
    /// does the file's next fsync) and never sent again. Sent later, after
    /// the close returned, one could land over what another node wrote to
    /// the file since (close-to-open), whichever owner takes it.
    pub(super) fn abandon(&self, ino: u64) {
        let lane = ino as usize % WRITE_LANES;
        // The lane's connection is hung up: an owner applies nothing it
        // reads from a connection its client hung up (it may be paused
        // with these writes in its socket buffer).
        if let Some(s) = self.lane_socks[lane].lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let upto = self.lane_seqs[lane].load(Ordering::Acquire);
        self.abandoned.lock().insert(ino, upto);
        self.journal.lock().lost.insert(ino);
        tracing::warn!(ino, "a file was closed while the owner had not answered its writes; they count as lost");
    }

    /// Whether write `tag` to `ino` was given up by its file's close.
    pub(super) fn abandoned(&self, ino: u64, tag: RequestTag) -> bool {
        tag.slot & PIPELINED_SLOT != 0 && self.abandoned.lock().get(&ino).is_some_and(|&upto| tag.seq <= upto)
    }

    /// Reads the answers to every write in flight on `lane`.
    pub(super) fn settle_lane(&self, lane: &mut Lane) {
        // Each turn answers one write or empties the lane.
        while !lane.sent.is_empty() {
            self.settle_one(lane);
        }
    }

    /// Reads the answer to the oldest write in flight on `lane`; if the
    /// connection broke, sends every write in flight again instead.
    pub(super) fn settle_one(&self, lane: &mut Lane) {
        if let Err(broken) = self.read_one(lane) {
            self.drop_conn(lane);
            match broken {
                Broken::Session => *self.session.lock() = None,
                Broken::Connection => self.forget_owner(),
            }
            self.resend_lane(lane);
        }
    }

    /// Reads the owner's answer to the oldest write in flight on `lane`.
    pub(super) fn read_one(&self, lane: &mut Lane) -> std::result::Result<(), Broken> {
        use crate::branch::frames::{read_answer, Answer};
        let Some(front) = lane.sent.front() else { return Ok(()) };
        let (tag, ino, len, epoch) = (front.tag, front.at.ino, front.data.len(), front.epoch);
        let c = lane.conn.as_mut().ok_or(Broken::Connection)?;
        if self.opts.timeout.is_none() && self.await_answer(c, &lane.addr).is_err() {
            return Err(Broken::Connection);
        }
        match read_answer(&mut c.stream, &mut c.rbuf) {
            Ok(Answer::Reply(reply)) => {
                lane.sent.pop_front();
                lane.bytes -= len;
                self.written(tag, ino, len, reply, epoch);
                Ok(())
            }
            Ok(Answer::UnknownSession) => Err(Broken::Session),
            Ok(Answer::Session(_)) | Err(_) => Err(Broken::Connection),
        }
    }

    /// The owner's answer to write `tag` of `len` bytes to `ino`.
    pub(super) fn written(&self, tag: RequestTag, ino: u64, len: usize, reply: Reply, epoch: u64) {
        let errno = match reply {
            Ok(Out::Written(n)) if n as usize == len => {
                return self.answered(tag, Some(ino), Vec::new(), Who::default(), epoch)
            }
            // The volume writes all or nothing; anything else is a fault.
            Ok(_) => libc::EIO,
            Err(errno) => errno,
        };
        tracing::debug!(ino, errno, "the owner refused a write in flight");
        self.journal.lock().failed.entry(ino).or_insert(errno);
    }

    /// Sends `lane`'s writes in flight again, in order, with their tags
    /// (their connection broke: the owner may or may not have them, and
    /// applies each at most once) — to the owner they were sent to only.
    /// Once another owner answers, a write is asked about instead: it had
    /// it, or it is lost (its `write` returned long ago; sent now, it could
    /// land over what another client wrote since).
    pub(super) fn resend_lane(&self, lane: &mut Lane) {
        while let Some(w) = lane.sent.pop_front() {
            lane.bytes -= w.data.len();
            let ino = w.at.ino;
            if self.journal.lock().gone.contains(&ino) {
                // The owner restarted without this file: it is lost, and
                // the number may name another file now.
                continue;
            }
            if self.abandoned(ino, w.tag) {
                // Its file's close reported it lost.
                continue;
            }
            let len = w.data.len();
            let (out, _) = self.call_tagged(w.at.op(w.data.to_vec()), Some(w.tag), Some(w.session));
            match out {
                Err(_) if self.abandoned(ino, w.tag) => {}
                Err(e) if e.errno() == libc::ESTALE => {
                    let epoch = (*self.session.lock()).map_or(0, |s| s.epoch);
                    // The same owner under a new session (ours expired):
                    // its floor says the lane got that far, not whether
                    // this write succeeded, and its refusal may have been
                    // the answer we lost. Counted lost: a false alarm at
                    // worst, never a refused write acknowledged.
                    if epoch != w.epoch && self.owner_had(epoch, w.tag) {
                        self.answered(w.tag, Some(ino), Vec::new(), Who::default(), epoch);
                    } else {
                        tracing::warn!(
                            ino,
                            "a write in flight was lost with the owner or our session; its file's fsync and close fail"
                        );
                        let mut j = self.journal.lock();
                        j.lost.insert(ino);
                        j.failed.entry(ino).or_insert(libc::EIO);
                    }
                }
                // `call_tagged` journaled a success.
                Ok(_) => {}
                Err(e) => self.written(w.tag, ino, len, Err(e.errno()), w.epoch),
            }
        }
    }

    /// The error a write in flight to `ino` met, once.
    pub(super) fn take_failed(&self, ino: u64) -> Result<()> {
        match self.journal.lock().failed.remove(&ino) {
            Some(errno) => Err(errno_error(errno)),
            None => Ok(()),
        }
    }
}
