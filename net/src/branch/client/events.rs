//! What other nodes change: the owner's events, polled, and dropped from
//! the kernel's caches.

use super::*;

impl Inner {
    /// Drops what other nodes changed from the kernel's caches (and our
    /// located reads), and moves `after` past it.
    pub(super) fn invalidate(&self, kernel: &dyn Invalidate, ev: Events, after: &mut u64) {
        if self.owner_changed.swap(false, Ordering::AcqRel) {
            // The new owner may lack what the old one answered: the pages
            // and attributes the kernel keeps of open files may hold it.
            let open: Vec<u64> = self.open.lock().keys().copied().collect();
            for ino in open {
                kernel.inode(ino);
            }
        }
        if ev.gap {
            // Located reads of files changed in the gap would go stale.
            if let Some(d) = &self.direct {
                d.forget_all();
            }
            tracing::debug!("missed some changes of other nodes; the kernel's short timeouts cover them");
        }
        *after = ev.next;
        for e in ev.items {
            match e {
                Event::Inode(ino) => {
                    if let Some(d) = &self.direct {
                        d.forget(ino);
                    }
                    kernel.inode(ino);
                }
                Event::Entry(parent, name) => kernel.entry(parent, &name),
            }
        }
    }

    /// One poll under session `s` for what other nodes changed since `after`.
    pub(super) async fn poll(&self, s: SessionInfo, after: u64) -> std::result::Result<(SessionInfo, Events), Failed> {
        let after = if after == 0 { s.seq } else { after };
        let q = format!("/events?session={:016x}&after={after}", s.session);
        let body = self.get(&q).await?;
        let ev = decode_value(&body, "events").map_err(|_| Failed::Transport("garbled events".into()))?;
        Ok((s, ev))
    }
}

impl BranchClient {
    /// Polls the owner for what other nodes change and drops it from the
    /// kernel's caches through `kernel`, until [`BranchClient::close`].
    /// The poll also tells the owner this mount is alive.
    pub fn follow(&self, kernel: impl Invalidate + 'static) -> std::io::Result<()> {
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let inner = self.inner.clone();
        let handle = self.rt.handle().clone();
        let t = std::thread::Builder::new().name("arbor-follow".into()).spawn(move || {
            let mut after = 0u64;
            let mut backoff = BACKOFF_MIN;
            // Whether `stop` came while waiting `d`.
            let wait = |stop: &mut tokio::sync::oneshot::Receiver<()>, d: Duration| {
                handle.block_on(async {
                    tokio::select! {
                        _ = stop => true,
                        _ = tokio::time::sleep(d) => false,
                    }
                })
            };
            loop {
                // The session is opened outside the runtime: finding the
                // owner may read the bucket, which blocks on a runtime of
                // its own, and a new owner is asked about our requests.
                let sent = BootInstant::now();
                let mut used = 0;
                let polled = match inner.session() {
                    Ok(s) => {
                        used = s.session;
                        let poll = inner.poll(s, after);
                        let got = handle.block_on(async {
                            tokio::select! {
                                _ = &mut stop_rx => None,
                                p = poll => Some(p),
                            }
                        });
                        match got {
                            Some(p) => p,
                            None => return,
                        }
                    }
                    Err(e) => Err(e),
                };
                match polled {
                    Ok((_, ev)) => {
                        inner.heard_at(sent);
                        if backoff != BACKOFF_MIN {
                            inner.locator.answered();
                        }
                        backoff = BACKOFF_MIN;
                        inner.invalidate(&kernel, ev, &mut after);
                    }
                    Err(Failed::Session) => {
                        inner.drop_session(used);
                        after = 0;
                    }
                    Err(_) => {
                        after = 0;
                        if wait(&mut stop_rx, backoff) {
                            return;
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
        })?;
        *self.events.lock() = Some((stop_tx, t));
        Ok(())
    }
}
