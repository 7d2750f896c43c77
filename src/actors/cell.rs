//! The one execution model of the actors on the data path (the producer,
//! [`super::prefill::producer`], and the layer writer,
//! [`super::prefill::writer`]): **an actor whose state sits behind a lock,
//! so that a message may be run on the sender's thread when running it
//! there cannot be told from running it on the actor's**.
//!
//! An [`ActorCell`] holds the actor's state, its address, and how many
//! messages sent through the cell ([`ActorCell::send`]) the actor has not
//! handled yet (its inbox). The rules, written once here:
//!
//! 1. **A handler** runs on the actor's thread and takes the lock for the
//!    whole handler ([`ActorCell::handle`]); a counted message leaves the
//!    inbox before the lock is let go.
//! 2. **An inline run** ([`ActorCell::try_inline`]) runs a message's effect
//!    on the sender's thread only if the inbox is empty and still is once
//!    the sender has the lock. Otherwise the sender sends the message
//!    instead. So the actor sees every message one at a time and in the
//!    order its senders caused them: whatever was sent before is handled
//!    before, whatever is sent concurrently is ordered either way.
//! 3. **No one waits for a lock while holding another.** A sender that
//!    holds no lock (the worker's thread handing a layer to its producer)
//!    may wait for the lock ([`Wait::Yes`]); one that holds a lock (a
//!    producer handing a write to its writer lane under its own lock, a
//!    lane feeding a write's end to its producer under its own) only tries
//!    it ([`Wait::No`]) and sends the message if it is taken. The other
//!    locks of the data path (the writer pool's map, a request's source
//!    blocks and layer pieces, the staging arena) are taken under an
//!    actor's and their holders never take an actor's. So no two threads
//!    can wait for each other.
//! 4. **What runs under a lock is bounded**: planning a layer's ranges,
//!    counting a write's end and, for a writer, one Mooncake submit of at
//!    most `inline_submit_max_ranges` ranges (inline) or of one batch (on
//!    its thread). No one sleeps, polls or waits for a peer under a lock, so
//!    a handler or a waiting sender waits for a lock at most that long.
//!
//! Other readers (the façade's queries, e.g. whether a request's pages may
//! go back) take the lock like a handler ([`ActorCell::lock`]) and change
//! nothing a message would not.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use actix::prelude::*;
use parking_lot::{Mutex, MutexGuard};

/// Whether an inline run may wait for the actor's lock (rule 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// The sender holds no lock: it waits for a handler or another inline
    /// run to end (rule 4 bounds that).
    Yes,
    /// The sender holds a lock: it only tries, and sends if it is taken.
    No,
}

/// An actor's state, its address and its inbox count, shared by the actor
/// and the references that reach it (the module's rules).
pub struct ActorCell<S, A: Actor> {
    state: Mutex<S>,
    /// Messages sent through [`Self::send`] and not handled yet.
    inbox: AtomicUsize,
    /// The actor (set once it started, before anyone can reach the cell).
    addr: OnceLock<Addr<A>>,
}

impl<S, A> ActorCell<S, A>
where
    A: Actor<Context = Context<A>>,
{
    /// A cell whose actor is not started yet ([`Self::started`]).
    pub fn new(state: S) -> Self {
        Self {
            state: Mutex::new(state),
            inbox: AtomicUsize::new(0),
            addr: OnceLock::new(),
        }
    }

    /// The actor started at `addr` (once, before the cell is shared).
    pub fn started(&self, addr: Addr<A>) {
        if self.addr.set(addr).is_err() {
            debug_assert!(false, "an actor cell's address is set once");
        }
    }

    /// The actor's address.
    pub fn addr(&self) -> &Addr<A> {
        self.addr
            .get()
            .expect("an actor cell's address is set when it starts")
    }

    /// Sends `msg` to the actor, counted in the inbox until handled (its
    /// handler must use [`Self::handle`] with `counted`).
    pub fn send<M>(&self, msg: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<M>,
    {
        self.inbox.fetch_add(1, Ordering::SeqCst);
        self.addr().do_send(msg);
    }

    /// Messages sent and not handled yet.
    pub fn pending(&self) -> usize {
        self.inbox.load(Ordering::SeqCst)
    }

    /// Rules 2 and 3: runs `f` on this thread under the lock if nothing
    /// sent is unhandled (and, with [`Wait::No`], the lock is free now); `f`
    /// may still decline (`None`: its own conditions). `None`: not run;
    /// send instead.
    pub fn try_inline<R>(&self, wait: Wait, f: impl FnOnce(&mut S) -> Option<R>) -> Option<R> {
        if self.pending() != 0 {
            return None;
        }
        let mut st = match wait {
            Wait::Yes => self.state.lock(),
            Wait::No => self.state.try_lock()?,
        };
        // Checked again under the lock: a message sent meanwhile was sent
        // concurrently with this call (either order is one the sender
        // could have seen); one sent before is counted or already handled.
        if self.pending() != 0 {
            return None;
        }
        f(&mut st)
    }

    /// Rule 1: runs a handler's `f` under the lock; a message sent through
    /// [`Self::send`] (`counted`) leaves the inbox once handled, before the
    /// lock is let go.
    pub fn handle<R>(&self, counted: bool, f: impl FnOnce(&mut S) -> R) -> R {
        let mut st = self.state.lock();
        let out = f(&mut st);
        if counted {
            self.inbox.fetch_sub(1, Ordering::SeqCst);
        }
        out
    }

    /// The state, for a reader that is not a message (it waits like a
    /// handler).
    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.state.lock()
    }

    /// The state if its lock is free now.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, S>> {
        self.state.try_lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter;
    impl Actor for Counter {
        type Context = Context<Self>;
    }

    #[derive(Message)]
    #[rtype(result = "()")]
    struct Add;

    impl Handler<Add> for Counter {
        type Result = ();
        fn handle(&mut self, _: Add, _: &mut Context<Self>) {}
    }

    /// Pushes `x` inline if the cell lets it.
    fn push(cell: &ActorCell<Vec<u32>, Counter>, wait: Wait, x: u32) -> bool {
        cell.try_inline(wait, |v| {
            v.push(x);
            Some(())
        })
        .is_some()
    }

    #[test]
    fn an_inline_run_waits_only_when_told_and_never_overtakes_a_sent_message() {
        let sys = System::new();
        sys.block_on(async {
            let cell = ActorCell::<Vec<u32>, Counter>::new(Vec::new());
            cell.started(Counter.start());
            // free and nothing pending: runs here
            assert!(push(&cell, Wait::No, 1));
            // its own conditions may decline
            assert_eq!(cell.try_inline(Wait::Yes, |_| None::<()>), None);
            // the lock taken (by a handler or a reader): a sender that
            // holds a lock does not wait for it
            {
                let _held = cell.lock();
                assert!(!push(&cell, Wait::No, 2));
            }
            // a message sent and not handled: not run ahead of it, waiting or not
            cell.send(Add);
            assert_eq!(cell.pending(), 1);
            assert!(!push(&cell, Wait::No, 4));
            assert!(!push(&cell, Wait::Yes, 4));
            // handled (counted): the inbox is empty again, inline runs resume
            cell.handle(true, |v| v.push(3));
            assert_eq!(cell.pending(), 0);
            assert!(push(&cell, Wait::Yes, 5));
            assert_eq!(*cell.lock(), vec![1, 3, 5]);
        });
    }

    #[test]
    fn a_sender_that_holds_no_lock_waits_for_the_one_held_now() {
        let cell = std::sync::Arc::new(ActorCell::<Vec<u32>, Counter>::new(Vec::new()));
        let held = cell.lock();
        let other = cell.clone();
        let t = std::thread::spawn(move || push(&other, Wait::Yes, 7));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!t.is_finished(), "it waits for the lock");
        drop(held);
        assert!(t.join().unwrap(), "and runs once it is free");
        assert_eq!(*cell.lock(), vec![7]);
    }
}
