//! The transports of a private mesh: libp2p's pre-shared-key layer (`pnet`) under Noise.
//!
//! Every connection (TCP, the relay client's circuits, and so DCUtR's punched connections,
//! which are TCP) first exchanges 24-byte nonces, then everything it carries is XSalsa20
//! encrypted with the swarm key. pnet itself authenticates nothing: with another key (or none)
//! the bytes after the nonces are noise, and multistream-select would wait for a frame length
//! that never arrives. So each side checks the first bytes it decrypts against the header every
//! libp2p connection begins with (`/multistream/1.0.0`), and drops the connection at the first
//! byte that differs, with [`P2pError::SwarmKeyMismatch`]. That check changes nothing on the
//! wire: a member still speaks standard pnet with go-libp2p holding the same key.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::{AsyncRead, AsyncWrite};
use libp2p::core::ConnectedPoint;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::{PnetConfig, PnetOutput, PreSharedKey};
use libp2p::{Multiaddr, PeerId, Transport, noise, yamux};

use crate::P2pError;
use crate::swarm_key::SwarmKey;

/// The first bytes each side of a libp2p connection sends: multistream-select's header, a
/// length byte (19) and `/multistream/1.0.0\n`.
const CONNECTION_PREFACE: &[u8] = b"\x13/multistream/1.0.0\n";

/// The label under which refused connections are counted.
pub(crate) const REFUSED_SWARM_KEY: &str = "swarm_key";

/// Where an incoming connection came from and where its refusal is counted.
struct Incoming {
    from: Multiaddr,
    metrics: meshnet_metrics::Metrics,
}

/// A stream that fails its read at the first decrypted byte that is not where a libp2p
/// connection's preface would be. An incoming connection failing so is counted as refused.
pub(crate) struct PrefaceCheck<S> {
    inner: S,
    /// Preface bytes already seen.
    checked: usize,
    /// Set for incoming connections.
    incoming: Option<Incoming>,
}

impl<S: AsyncRead + Unpin> AsyncRead for PrefaceCheck<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let read = ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if this.checked < CONNECTION_PREFACE.len() {
            let compared = read.min(CONNECTION_PREFACE.len() - this.checked);
            let expected = &CONNECTION_PREFACE[this.checked..this.checked + compared];
            if buf[..compared] != *expected {
                // Counted once: the connection is dropped on this error.
                if let Some(incoming) = this.incoming.take() {
                    tracing::debug!(from = %incoming.from, "refused a connection: no or another swarm key");
                    incoming.metrics.count_connection_refused(REFUSED_SWARM_KEY);
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    P2pError::SwarmKeyMismatch,
                )));
            }
            this.checked += compared;
            if this.checked == CONNECTION_PREFACE.len() {
                // A libp2p handshake under this key: nothing more to count or check.
                this.incoming = None;
            }
        }
        Poll::Ready(Ok(read))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PrefaceCheck<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// Runs the pnet handshake on `socket` and puts the preface check above it.
async fn guard<S>(
    key: PreSharedKey,
    socket: S,
    endpoint: ConnectedPoint,
    metrics: meshnet_metrics::Metrics,
) -> io::Result<PrefaceCheck<PnetOutput<S>>>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let inner = PnetConfig::new(key)
        .handshake(socket)
        .await
        .map_err(io::Error::other)?;
    let incoming = match endpoint {
        ConnectedPoint::Listener { send_back_addr, .. } => Some(Incoming {
            from: send_back_addr,
            metrics,
        }),
        ConnectedPoint::Dialer { .. } => None,
    };
    Ok(PrefaceCheck {
        inner,
        checked: 0,
        incoming,
    })
}

/// `transport` behind the swarm key, then Noise and Yamux as the open mesh has them.
pub(crate) fn private_transport<T>(
    transport: T,
    keypair: &Keypair,
    key: &SwarmKey,
    metrics: &meshnet_metrics::Metrics,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>>
where
    T: Transport + Send + Unpin + 'static,
    T::Output: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    let key = PreSharedKey::new(*key.as_bytes());
    let metrics = metrics.clone();
    Ok(transport
        .and_then(move |socket, endpoint| guard(key, socket, endpoint, metrics.clone()))
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair)?)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

/// The swarm key's fingerprint as go-libp2p prints it: operators compare it, never the key.
pub fn swarm_key_fingerprint(key: &SwarmKey) -> String {
    PreSharedKey::new(*key.as_bytes()).fingerprint().to_string()
}

/// Whether `address` is a QUIC address (which a private mesh cannot use).
pub fn is_quic(address: &Multiaddr) -> bool {
    address
        .iter()
        .any(|protocol| matches!(protocol, Protocol::QuicV1 | Protocol::Quic))
}
