//! The tracker's book and its readers. The control loop owns the book ([`OwnedBook`]) and is
//! its only writer; after every change it publishes the book's [`RouteTable`] through a
//! `watch` channel. Generations and `/status` read that table ([`PublishedRoutes`]); what a
//! generation has to tell the book (a hop that failed it, a member caught lying, a checked
//! session) goes back to the loop as a [`BookCommand`] on a bounded queue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshnet_types::{LayerSpan, PeerId};
use tokio::sync::{mpsc, watch};

use crate::route_table::RouteTable;
use crate::routing::{MeshRoutes, PlannedHop, Uncovered};
use crate::tracker::TrackerBook;
use crate::verify::Evidence;

/// How many commands may wait for the control loop. It takes them as they come, so this is
/// reached only when it stalls; a command that finds the queue full is dropped with a warning
/// (a ban or a conviction lost costs a retried route, never a wrong answer: the generation that
/// reported it routes around the peer itself).
const COMMAND_QUEUE: usize = 256;

/// A change a generation asks of the tracker's book.
#[derive(Debug)]
pub(crate) enum BookCommand {
    /// Keep `peer` off routes for a while: it failed a generation at `at` because of `cause`.
    Ban {
        /// The peer.
        peer: PeerId,
        /// What went wrong.
        cause: String,
        /// When.
        at: Instant,
    },
    /// `peer` returned wrong activations: keep it off routes for `duration` from `at`.
    Convict {
        /// The peer.
        peer: PeerId,
        /// The step and outputs that convict it.
        evidence: Box<Evidence>,
        /// How long it stays off routes.
        duration: Duration,
        /// When it was caught.
        at: Instant,
    },
    /// `peer` passed a checked session.
    Verified(PeerId),
}

impl BookCommand {
    /// Carries the command out on `book`.
    fn apply(self, book: &mut TrackerBook) {
        match self {
            BookCommand::Ban { peer, cause, at } => book.ban(&peer, &cause, at),
            BookCommand::Convict {
                peer,
                evidence,
                duration,
                at,
            } => book.convict(&peer, *evidence, duration, at),
            BookCommand::Verified(peer) => book.record_verified(&peer),
        }
    }
}

/// The tracker's book with what it needs to publish: held by the control loop alone.
pub(crate) struct OwnedBook {
    book: TrackerBook,
    table: watch::Sender<Arc<RouteTable>>,
    commands: mpsc::Receiver<BookCommand>,
}

impl OwnedBook {
    /// Takes `book` in and returns it with the readers of its table.
    pub(crate) fn new(book: TrackerBook) -> (Self, PublishedRoutes) {
        let (table, table_rx) = watch::channel(Arc::new(book.table().clone()));
        let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
        let routes = PublishedRoutes {
            table: table_rx,
            commands: commands_tx,
        };
        (
            OwnedBook {
                book,
                table,
                commands,
            },
            routes,
        )
    }

    /// The book, to read.
    pub(crate) fn book(&self) -> &TrackerBook {
        &self.book
    }

    /// Changes the book with `change` and publishes its table; returns what `change` did.
    pub(crate) fn change<T>(&mut self, change: impl FnOnce(&mut TrackerBook) -> T) -> T {
        let outcome = change(&mut self.book);
        self.table.send_replace(Arc::new(self.book.table().clone()));
        outcome
    }

    /// The next command a generation sent (waits for one).
    pub(crate) async fn next_command(&mut self) -> Option<BookCommand> {
        self.commands.recv().await
    }

    /// Carries out `command` and publishes the table.
    pub(crate) fn apply(&mut self, command: BookCommand) {
        self.change(|book| command.apply(book));
    }
}

/// What generations and `/status` read of the tracker's book: its latest published table.
pub(crate) struct PublishedRoutes {
    table: watch::Receiver<Arc<RouteTable>>,
    commands: mpsc::Sender<BookCommand>,
}

impl PublishedRoutes {
    /// The table as last published.
    pub(crate) fn table(&self) -> Arc<RouteTable> {
        Arc::clone(&self.table.borrow())
    }

    /// Queues `command` for the book's owner; dropped with a warning when the queue is full,
    /// and quietly when the owner is gone (this member stopped being the tracker).
    fn send(&self, command: BookCommand) {
        match self.commands.try_send(command) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(command)) => {
                tracing::warn!(?command, "the tracker's book is busy: a report was dropped");
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

impl MeshRoutes for PublishedRoutes {
    fn route(&self, start: u32, avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered> {
        self.table().route_avoiding(start, avoid, Instant::now())
    }

    fn ban(&self, peer: &PeerId, cause: &str) {
        self.send(BookCommand::Ban {
            peer: peer.clone(),
            cause: cause.to_owned(),
            at: Instant::now(),
        });
    }

    fn first_silent(&self, peers: &[PeerId]) -> Option<PeerId> {
        self.table().first_silent(peers, Instant::now())
    }

    fn holders(&self, layers: LayerSpan, avoid: &[PeerId]) -> Vec<PlannedHop> {
        self.table().holders(layers, avoid, Instant::now())
    }

    fn verified_sessions(&self, peer: &PeerId) -> u32 {
        self.table().verified_sessions(peer)
    }

    fn record_verified(&self, peer: &PeerId) {
        self.send(BookCommand::Verified(peer.clone()));
    }

    fn convict(&self, peer: &PeerId, evidence: Evidence, duration: Duration) {
        self.send(BookCommand::Convict {
            peer: peer.clone(),
            evidence: Box::new(evidence),
            duration,
            at: Instant::now(),
        });
    }
}

#[cfg(test)]
mod tests {
    use meshnet_types::LayerSpan;

    use super::*;
    use crate::tracker::fixtures::{announcement, book, evidence};

    #[test]
    fn every_change_of_the_book_is_published_to_its_readers() {
        let (mut owned, routes) = OwnedBook::new(book());
        let before = routes.table();
        assert!(before.peers().is_empty());
        let joined = owned.change(|book| book.observe(announcement("a", None), Instant::now()));
        assert!(joined);
        assert_eq!(
            routes.table().peers().keys().collect::<Vec<_>>(),
            [&PeerId::new("a")]
        );
        // A snapshot taken before stays as it was.
        assert!(before.peers().is_empty());
    }

    #[tokio::test]
    async fn what_a_generation_reports_reaches_the_book_through_its_owner() {
        let (mut owned, routes) = OwnedBook::new(book());
        let liar = PeerId::new("liar");
        routes.ban(&liar, "timed out");
        routes.record_verified(&liar);
        routes.record_verified(&liar);
        // Nothing changes until the owner takes the commands.
        assert!(!routes.table().is_banned(&liar, Instant::now()));
        assert_eq!(routes.verified_sessions(&liar), 0);
        for _ in 0..3 {
            let command = owned.next_command().await.unwrap();
            owned.apply(command);
        }
        let table = routes.table();
        assert_eq!(table.bans(Instant::now())[0].1.cause, "timed out");
        assert_eq!(routes.verified_sessions(&liar), 2);
        // A conviction carries its evidence and restarts probation.
        routes.convict(
            &liar,
            evidence(LayerSpan::new(10, 20)),
            Duration::from_secs(60),
        );
        let command = owned.next_command().await.unwrap();
        owned.apply(command);
        assert!(routes.table().is_convicted(&liar, Instant::now()));
        assert_eq!(routes.verified_sessions(&liar), 0);
        assert_eq!(owned.book().table().verified_sessions(&liar), 0);
    }

    #[tokio::test]
    async fn a_full_queue_drops_the_newest_report_and_reports_to_a_gone_owner_go_nowhere() {
        let (mut owned, routes) = OwnedBook::new(book());
        let peer = PeerId::new("a");
        for _ in 0..=COMMAND_QUEUE {
            routes.record_verified(&peer);
        }
        let mut taken = 0;
        while let Ok(command) = owned.commands.try_recv() {
            owned.apply(command);
            taken += 1;
        }
        assert_eq!(taken, COMMAND_QUEUE);
        assert_eq!(routes.verified_sessions(&peer), COMMAND_QUEUE as u32);
        drop(owned);
        // The member stopped being the tracker: reports go nowhere, quietly.
        routes.ban(&peer, "late");
        assert_eq!(routes.verified_sessions(&peer), COMMAND_QUEUE as u32);
    }
}
