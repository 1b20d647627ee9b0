//! The relay over real sockets on 127.0.0.1: what it passes on, and the least time it takes.

#![allow(clippy::unwrap_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::num::NonZeroU64;
use std::sync::mpsc;
use std::time::Duration;

use meshnet_linkem::{LinkShape, LinkemError, Relay};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout};

/// Every test gives up after this long instead of hanging.
const PATIENCE: Duration = Duration::from_secs(20);

fn localhost() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// A target that reads each connection to its end, then answers with what it read, reversed,
/// and closes.
async fn reversing_target() -> SocketAddr {
    let listener = TcpListener::bind(localhost()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                stream.read_to_end(&mut got).await.unwrap();
                got.reverse();
                stream.write_all(&got).await.unwrap();
            });
        }
    });
    addr
}

/// A relay to `target` shaped by `shape`, serving in the background; its address.
async fn relay_to(target: SocketAddr, shape: LinkShape) -> SocketAddr {
    let relay = Relay::bind(localhost(), target, shape).await.unwrap();
    let addr = relay.local_addr().unwrap();
    tokio::spawn(relay.serve(|e| panic!("relay error: {e}")));
    addr
}

/// Sends `data` through `relay`, half-closes, and reads the answer to its end.
async fn exchange(relay: SocketAddr, data: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(relay).await.unwrap();
    stream.write_all(data).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    answer
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

fn shaped(delay_ms: u64, rate: u64, burst: u64) -> LinkShape {
    LinkShape {
        delay: Duration::from_millis(delay_ms),
        jitter: Duration::ZERO,
        rate: NonZeroU64::new(rate),
        burst,
    }
}

#[tokio::test]
async fn bytes_and_ends_of_stream_pass_both_ways_unaltered() {
    let relay = relay_to(reversing_target().await, shaped(5, 0, 0)).await;
    let data = pattern(300_000);
    // The target answers only once the client's half-close has reached it, and the client's
    // read ends only once the target's close has come back.
    let answer = timeout(PATIENCE, exchange(relay, &data)).await.unwrap();
    let mut expected = data;
    expected.reverse();
    assert_eq!(answer.len(), expected.len());
    assert!(
        answer == expected,
        "the answer differs from the data reversed"
    );
}

#[tokio::test]
async fn a_round_trip_takes_at_least_twice_the_delay() {
    let relay = relay_to(reversing_target().await, shaped(40, 0, 0)).await;
    let started = Instant::now();
    let answer = timeout(PATIENCE, exchange(relay, b"ab")).await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(answer, b"ba");
    assert!(elapsed >= Duration::from_millis(80), "{elapsed:?}");
}

#[tokio::test]
async fn a_transfer_takes_at_least_its_length_past_the_burst_over_the_rate() {
    // 100,000 B/s with a 10,000-byte bucket: 60,000 bytes need 0.5 s after the burst one way,
    // and the answer 0.5 s more back, plus 2 × 10 ms of delay.
    let relay = relay_to(reversing_target().await, shaped(10, 100_000, 10_000)).await;
    let started = Instant::now();
    let answer = timeout(PATIENCE, exchange(relay, &pattern(60_000)))
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(answer.len(), 60_000);
    assert!(elapsed >= Duration::from_millis(1020), "{elapsed:?}");
}

#[tokio::test]
async fn connections_of_one_link_share_its_bandwidth() {
    // Two connections of 30,000 bytes each at 100,000 B/s, a 10,000-byte bucket. Alone, each
    // would need 0.2 s past the burst each way, 0.4 s in all. Sharing, the first answer starts
    // back no earlier than 0.2 s, and both answers, 60,000 bytes, need 0.5 s past the burst.
    let relay = relay_to(reversing_target().await, shaped(0, 100_000, 10_000)).await;
    let data = pattern(30_000);
    let started = Instant::now();
    let both = async { tokio::join!(exchange(relay, &data), exchange(relay, &data)) };
    let (first, second) = timeout(PATIENCE, both).await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!((first.len(), second.len()), (30_000, 30_000));
    assert!(elapsed >= Duration::from_millis(700), "{elapsed:?}");
}

#[tokio::test]
async fn an_unreachable_target_closes_the_connection_and_is_reported() {
    let gone = {
        let listener = TcpListener::bind(localhost()).await.unwrap();
        listener.local_addr().unwrap()
    };
    let relay = Relay::bind(localhost(), gone, shaped(0, 0, 0))
        .await
        .unwrap();
    let addr = relay.local_addr().unwrap();
    let (reports, reported) = mpsc::channel();
    tokio::spawn(relay.serve(move |e| reports.send(e).unwrap()));
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut answer = Vec::new();
    let read = timeout(PATIENCE, stream.read_to_end(&mut answer)).await;
    // Closed without a byte (cleanly or by reset, as the OS has it).
    assert!(answer.is_empty());
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "{read:?}");
    let report = reported.recv_timeout(PATIENCE).unwrap();
    assert!(
        matches!(report, LinkemError::Dial { target, .. } if target == gone),
        "{report:?}"
    );
}

#[tokio::test]
async fn binding_a_taken_address_names_it() {
    let taken = TcpListener::bind(localhost()).await.unwrap();
    let addr = taken.local_addr().unwrap();
    let error = Relay::bind(addr, addr, shaped(0, 0, 0)).await.unwrap_err();
    assert!(matches!(error, LinkemError::Listen { addr: a, .. } if a == addr));
    assert!(error.to_string().contains(&addr.to_string()), "{error}");
}
