//! The entry's side of direct return (ADR-0031): the outputs it awaits from the last hops of
//! its routes, each under a ticket it drew for one frame.
//!
//! [`ReturnDesk::expect`] draws a ticket for a frame about to be sent and gives back an
//! [`AwaitedReturn`] that resolves when the last hop posts that frame's output to `/return`.
//! The desk accepts a ticket once, and only with a frame of the session, chunk and position it
//! was drawn for; dropping the [`AwaitedReturn`] withdraws the ticket, so nothing is left
//! behind when a send fails or its answer came back along the route instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use meshnet_wire::{ActivationFrame, FrameMeta, ReturnTicket, WireError};
use tokio::sync::oneshot;

/// Tickets a desk holds at most unless told otherwise: far more frames than an entry keeps
/// travelling (a few prefill chunks per generation).
pub const DEFAULT_RETURN_CAPACITY: usize = 4096;

/// The outputs an entry awaits, by ticket.
#[derive(Debug)]
pub struct ReturnDesk {
    awaited: Mutex<HashMap<ReturnTicket, Expected>>,
    capacity: usize,
}

/// What a ticket admits, and where the output goes.
#[derive(Debug)]
struct Expected {
    session: uuid::Uuid,
    chunk_index: u32,
    chunk_total: u32,
    position: u64,
    deliver: oneshot::Sender<ActivationFrame>,
}

/// One frame's output, awaited under its ticket; dropping it withdraws the ticket.
#[derive(Debug)]
pub struct AwaitedReturn {
    ticket: ReturnTicket,
    output: oneshot::Receiver<ActivationFrame>,
    desk: Arc<ReturnDesk>,
}

impl ReturnDesk {
    /// A desk holding at most `capacity` tickets at once.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(ReturnDesk {
            awaited: Mutex::new(HashMap::new()),
            capacity,
        })
    }

    /// Draws a ticket for the output of the frame `meta` describes; `None` when the desk is
    /// full (the frame then travels without a return address and its answer comes back along
    /// the route).
    pub fn expect(self: &Arc<Self>, meta: &FrameMeta) -> Option<AwaitedReturn> {
        let mut awaited = self.lock();
        if awaited.len() >= self.capacity {
            return None;
        }
        let ticket = loop {
            let ticket = ReturnTicket::from_bits(uuid::Uuid::new_v4().as_u128());
            if !awaited.contains_key(&ticket) {
                break ticket;
            }
        };
        let (deliver, output) = oneshot::channel();
        awaited.insert(
            ticket,
            Expected {
                session: meta.session,
                chunk_index: meta.chunk_index,
                chunk_total: meta.chunk_total,
                position: meta.position,
                deliver,
            },
        );
        Some(AwaitedReturn {
            ticket,
            output,
            desk: Arc::clone(self),
        })
    }

    /// Refuses (403) a ticket this desk does not hold, before its body is read.
    pub fn check(&self, ticket: ReturnTicket) -> Result<(), WireError> {
        if self.lock().contains_key(&ticket) {
            return Ok(());
        }
        Err(unknown_ticket())
    }

    /// Hands `frame` to whoever awaits `ticket`, once: refused (403) when the ticket is not
    /// held, or was drawn for another session, chunk or position (the ticket stays valid).
    pub fn deliver(&self, ticket: ReturnTicket, frame: ActivationFrame) -> Result<(), WireError> {
        let mut awaited = self.lock();
        let expected = awaited.get(&ticket).ok_or_else(unknown_ticket)?;
        let m = &frame.meta;
        if (m.session, m.chunk_index, m.chunk_total, m.position)
            != (
                expected.session,
                expected.chunk_index,
                expected.chunk_total,
                expected.position,
            )
        {
            return Err(WireError::ReturnRefused {
                reason: format!(
                    "the ticket is for session {} chunk {}/{} at {}, not session {} chunk {}/{} at {}",
                    expected.session,
                    expected.chunk_index,
                    expected.chunk_total,
                    expected.position,
                    m.session,
                    m.chunk_index,
                    m.chunk_total,
                    m.position
                ),
            });
        }
        if let Some(expected) = awaited.remove(&ticket) {
            // The receiver may be gone already (its send failed meanwhile): nothing to do.
            let _ = expected.deliver.send(frame);
        }
        Ok(())
    }

    /// Tickets held now.
    pub fn awaited(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<ReturnTicket, Expected>> {
        self.awaited
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn unknown_ticket() -> WireError {
    WireError::ReturnRefused {
        reason: "no frame awaits this ticket (unknown, withdrawn or already used)".to_owned(),
    }
}

impl AwaitedReturn {
    /// The ticket to send with the frame.
    pub fn ticket(&self) -> ReturnTicket {
        self.ticket
    }

    /// The output, once the last hop has posted it.
    pub async fn received(&mut self) -> Option<ActivationFrame> {
        (&mut self.output).await.ok()
    }
}

impl Drop for AwaitedReturn {
    fn drop(&mut self) {
        self.desk.lock().remove(&self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use meshnet_types::LayerSpan;
    use meshnet_wire::{Activations, Route, Shape};

    fn frame(session: u128, position: u64) -> ActivationFrame {
        ActivationFrame {
            meta: FrameMeta {
                session: uuid::Uuid::from_u128(session),
                chunk_index: 0,
                chunk_total: 1,
                position,
                layers: LayerSpan::new(3, 6),
                route: Route::default(),
                grant: None,
                fork_from: None,
                return_to: None,
                rewind: false,
            },
            activations: Activations::new(Shape::new(&[1, 1, 2]).unwrap(), vec![bf16::ONE; 2])
                .unwrap(),
        }
    }

    #[tokio::test]
    async fn a_ticket_admits_its_frame_once() {
        let desk = ReturnDesk::new(8);
        let mut awaited = desk.expect(&frame(1, 5).meta).unwrap();
        let ticket = awaited.ticket();
        assert!(desk.check(ticket).is_ok());
        desk.deliver(ticket, frame(1, 5)).unwrap();
        assert_eq!(awaited.received().await, Some(frame(1, 5)));
        assert!(matches!(
            desk.deliver(ticket, frame(1, 5)),
            Err(WireError::ReturnRefused { .. })
        ));
        assert!(desk.check(ticket).is_err());
    }

    #[tokio::test]
    async fn a_frame_of_another_session_or_position_is_refused_and_the_ticket_kept() {
        let desk = ReturnDesk::new(8);
        let mut awaited = desk.expect(&frame(1, 5).meta).unwrap();
        let ticket = awaited.ticket();
        for wrong in [frame(2, 5), frame(1, 6)] {
            assert!(matches!(
                desk.deliver(ticket, wrong),
                Err(WireError::ReturnRefused { .. })
            ));
        }
        let stranger = ReturnTicket::from_bits(ticket.to_string().len() as u128);
        assert!(desk.deliver(stranger, frame(1, 5)).is_err());
        desk.deliver(ticket, frame(1, 5)).unwrap();
        assert_eq!(awaited.received().await, Some(frame(1, 5)));
    }

    #[test]
    fn dropping_the_wait_withdraws_the_ticket_and_a_full_desk_draws_none() {
        let desk = ReturnDesk::new(2);
        let first = desk.expect(&frame(1, 0).meta).unwrap();
        let second = desk.expect(&frame(1, 1).meta).unwrap();
        assert_ne!(first.ticket(), second.ticket());
        assert!(desk.expect(&frame(1, 2).meta).is_none());
        let ticket = first.ticket();
        drop(first);
        assert_eq!(desk.awaited(), 1);
        assert!(desk.check(ticket).is_err());
        assert!(desk.expect(&frame(1, 2).meta).is_some());
    }
}
