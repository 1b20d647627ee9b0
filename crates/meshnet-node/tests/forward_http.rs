//! `POST /forward` through `oneshot` and against real servers on port 0.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use half::bf16;
use meshnet_node::{
    ActivationPlane, AwaitedReturn, ClientError, Delivery, ErrorBody, ExecutorError, ForwardClient,
    HopFailureKind, ReturnDesk, SpanExecutor,
};
use meshnet_types::LayerSpan;
use meshnet_wire::header::{DTYPE, ENCODING, SHAPE, WIRE_VERSION_HEADER};
use meshnet_wire::{
    ActivationFrame, Activations, Encoding, FrameMeta, Hop, Limits, ReturnAddress, ReturnTicket,
    Route, Shape,
};
use tower::ServiceExt;
use uuid::Uuid;

/// A stand-in for real layers: every layer adds 1 to every value, and every call is recorded.
struct AddOnePerLayer {
    serves: LayerSpan,
    overloaded: bool,
    calls: Mutex<Vec<(Uuid, u64, LayerSpan)>>,
    /// `X-Meshnet-Rewind` of every call, in order.
    rewinds: Mutex<Vec<bool>>,
}

impl AddOnePerLayer {
    fn new(start: u32, end: u32) -> Arc<Self> {
        Arc::new(AddOnePerLayer {
            serves: LayerSpan::new(start, end),
            overloaded: false,
            calls: Mutex::new(Vec::new()),
            rewinds: Mutex::new(Vec::new()),
        })
    }
}

impl SpanExecutor for AddOnePerLayer {
    fn served_layers(&self) -> Option<LayerSpan> {
        Some(self.serves)
    }

    fn forward(&self, meta: &FrameMeta, input: Activations) -> Result<Activations, ExecutorError> {
        if self.overloaded {
            return Err(ExecutorError::Overloaded);
        }
        self.calls
            .lock()
            .unwrap()
            .push((meta.session, meta.position, meta.layers));
        self.rewinds.lock().unwrap().push(meta.rewind);
        let add = meta.layers.len() as f32;
        let (shape, values) = input.into_parts();
        let values = values
            .into_iter()
            .map(|v| bf16::from_f32(v.to_f32() + add))
            .collect();
        Activations::new(shape, values).map_err(|e| ExecutorError::Compute(e.to_string()))
    }
}

fn limits() -> Limits {
    Limits {
        max_frame_bytes: 1 << 20,
    }
}

fn client() -> ForwardClient {
    ForwardClient::new(limits(), Duration::from_secs(10)).unwrap()
}

fn plane(executor: Arc<dyn SpanExecutor>) -> ActivationPlane {
    ActivationPlane::new(executor, limits(), client())
}

fn frame(layers: (u32, u32), route: Vec<Hop>, tokens: usize) -> ActivationFrame {
    let shape = Shape::new(&[1, tokens, 8]).unwrap();
    let values = (0..shape.elements())
        .map(|i| bf16::from_f32((i % 50) as f32))
        .collect();
    ActivationFrame {
        meta: FrameMeta {
            session: Uuid::new_v4(),
            chunk_index: 1,
            chunk_total: 3,
            position: 128,
            layers: LayerSpan::new(layers.0, layers.1),
            route: Route::new(route).unwrap(),
            grant: None,
            fork_from: None,
            return_to: None,
            rewind: false,
        },
        activations: Activations::new(shape, values).unwrap(),
    }
}

fn request(frame: &ActivationFrame, encoding: Encoding) -> Request<Body> {
    let encoded = frame.encode(encoding);
    let mut request = Request::post("/forward")
        .body(Body::from(encoded.body))
        .unwrap();
    *request.headers_mut() = encoded.headers;
    request
}

async fn error_of(response: axum::response::Response) -> ErrorBody {
    let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
    serde_json::from_slice(&body).unwrap_or_else(|e| panic!("not an error body ({e}): {body:?}"))
}

fn shifted(frame: &ActivationFrame, by: f32) -> Vec<bf16> {
    frame
        .activations
        .values()
        .iter()
        .map(|v| bf16::from_f32(v.to_f32() + by))
        .collect()
}

#[tokio::test]
async fn a_valid_frame_runs_the_span_and_answers_in_kind() {
    for encoding in [Encoding::Raw, Encoding::Zstd] {
        let executor = AddOnePerLayer::new(0, 10);
        let app = plane(executor.clone()).router();
        let sent = frame((2, 7), vec![], 4);
        let response = app.oneshot(request(&sent, encoding)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response
                .headers()
                .get(ENCODING)
                .map(|v| v.to_str().unwrap()),
            encoding.header_value()
        );
        let headers = response.headers().clone();
        let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let answer = ActivationFrame::decode(&headers, &body, &limits()).unwrap();
        assert_eq!(answer.meta.session, sent.meta.session);
        assert_eq!(answer.meta.position, 128);
        assert_eq!(answer.meta.layers, LayerSpan::new(2, 7));
        assert_eq!(answer.activations.values(), shifted(&sent, 5.0).as_slice());
        assert_eq!(
            *executor.calls.lock().unwrap(),
            vec![(sent.meta.session, 128, LayerSpan::new(2, 7))]
        );
    }
}

#[tokio::test]
async fn malformed_requests_get_their_status_and_a_json_reason() {
    type Breaker = Box<dyn Fn(&mut Request<Body>)>;
    let set = |name: &'static str, value: &'static str| -> Breaker {
        Box::new(move |r: &mut Request<Body>| {
            r.headers_mut().insert(name, value.parse().unwrap());
        })
    };
    let body = |bytes: Vec<u8>| -> Breaker {
        Box::new(move |r: &mut Request<Body>| *r.body_mut() = Body::from(bytes.clone()))
    };
    let cases: Vec<(&str, Encoding, Breaker, StatusCode, &str)> = vec![
        (
            "wrong version",
            Encoding::Raw,
            set(WIRE_VERSION_HEADER, "7"),
            StatusCode::BAD_REQUEST,
            "wire_version_mismatch",
        ),
        (
            "bad shape",
            Encoding::Raw,
            set(SHAPE, "1,x,8"),
            StatusCode::BAD_REQUEST,
            "invalid_shape",
        ),
        (
            "zero dim",
            Encoding::Raw,
            set(SHAPE, "1,0,8"),
            StatusCode::BAD_REQUEST,
            "invalid_shape",
        ),
        (
            "huge shape",
            Encoding::Raw,
            set(SHAPE, "1000000,1000000"),
            StatusCode::PAYLOAD_TOO_LARGE,
            "frame_too_large",
        ),
        (
            "overflowing shape",
            Encoding::Raw,
            set(SHAPE, "99999999999,99999999999,99999999999"),
            StatusCode::PAYLOAD_TOO_LARGE,
            "frame_too_large",
        ),
        (
            "body too large",
            Encoding::Raw,
            body(vec![0; 2 << 20]),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        ),
        (
            "unknown encoding",
            Encoding::Raw,
            set(ENCODING, "br"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_encoding",
        ),
        (
            "unknown dtype",
            Encoding::Raw,
            set(DTYPE, "float32"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_dtype",
        ),
        (
            "json content type",
            Encoding::Raw,
            set("content-type", "application/json"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_type",
        ),
        (
            "short body",
            Encoding::Raw,
            body(vec![0; 10]),
            StatusCode::UNPROCESSABLE_ENTITY,
            "length_mismatch",
        ),
        (
            "zstd past the shape",
            Encoding::Zstd,
            body(zstd::bulk::compress(&[0u8; 4096], 1).unwrap()),
            StatusCode::UNPROCESSABLE_ENTITY,
            "decompressed_too_large",
        ),
        (
            "corrupt zstd",
            Encoding::Zstd,
            body(vec![0x28, 0xb5, 0x2f, 0xfd, 1, 2, 3]),
            StatusCode::BAD_REQUEST,
            "corrupt_compression",
        ),
        (
            "layers not served",
            Encoding::Raw,
            set("x-meshnet-layers", "5-15"),
            StatusCode::CONFLICT,
            "layers_not_served",
        ),
    ];
    let app = plane(AddOnePerLayer::new(0, 10)).router();
    for (name, encoding, breaker, status, code) in cases {
        let mut req = request(&frame((0, 10), vec![], 4), encoding);
        breaker(&mut req);
        let response = app.clone().oneshot(req).await.unwrap();
        assert_eq!(response.status(), status, "{name}");
        assert_eq!(
            response.headers()[WIRE_VERSION_HEADER],
            "1",
            "{name}: every answer names our wire version"
        );
        let error = error_of(response).await;
        assert_eq!(error.error.code, code, "{name}: {}", error.error.message);
        assert!(!error.error.message.is_empty());
    }
}

#[tokio::test]
async fn an_overloaded_peer_answers_503_with_retry_after() {
    let executor = Arc::new(AddOnePerLayer {
        serves: LayerSpan::new(0, 10),
        overloaded: true,
        calls: Mutex::new(Vec::new()),
        rewinds: Mutex::new(Vec::new()),
    });
    let response = plane(executor)
        .router()
        .oneshot(request(&frame((0, 10), vec![], 2), Encoding::Raw))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(error_of(response).await.error.code, "overloaded");
}

/// Starts a peer on a free loopback port and returns its base URL.
async fn serve(executor: Arc<dyn SpanExecutor>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = plane(executor).router();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_frame_travels_the_whole_route_and_back() {
    let a = AddOnePerLayer::new(0, 10);
    let b = AddOnePerLayer::new(10, 20);
    let c = AddOnePerLayer::new(18, 30);
    let (url_a, url_b, url_c) = (
        serve(a.clone()).await,
        serve(b.clone()).await,
        serve(c.clone()).await,
    );
    for encoding in [Encoding::Raw, Encoding::Zstd] {
        let route = vec![
            Hop::new(LayerSpan::new(10, 20), url_b.clone()).unwrap(),
            Hop::new(LayerSpan::new(20, 30), url_c.clone()).unwrap(),
        ];
        let sent = frame((0, 10), route, 130);
        let answer = client()
            .forward(&endpoint(&url_a), sent.clone(), encoding)
            .await
            .unwrap();
        assert_eq!(answer.meta.layers, LayerSpan::new(0, 30));
        assert!(answer.meta.route.is_empty());
        assert_eq!(answer.activations.values(), shifted(&sent, 30.0).as_slice());
        // Peer c holds 18..30 but the route asked it for 20..30 only.
        let last = c.calls.lock().unwrap().last().copied().unwrap();
        assert_eq!(last, (sent.meta.session, 128, LayerSpan::new(20, 30)));
    }
    assert_eq!(a.calls.lock().unwrap().len(), 2);
    assert_eq!(b.calls.lock().unwrap().len(), 2);
}

/// A rewind reaches every hop of the route, and the answer carries none.
#[tokio::test]
async fn a_rewind_reaches_every_hop_and_the_answer_carries_none() {
    let a = AddOnePerLayer::new(0, 10);
    let b = AddOnePerLayer::new(10, 30);
    let (url_a, url_b) = (serve(a.clone()).await, serve(b.clone()).await);
    for rewind in [true, false] {
        let route = vec![Hop::new(LayerSpan::new(10, 30), url_b.clone()).unwrap()];
        let mut sent = frame((0, 10), route, 3);
        sent.meta.rewind = rewind;
        let answer = client()
            .forward(&endpoint(&url_a), sent, Encoding::Raw)
            .await
            .unwrap();
        assert!(!answer.meta.rewind);
    }
    assert_eq!(*a.rewinds.lock().unwrap(), [true, false]);
    assert_eq!(*b.rewinds.lock().unwrap(), [true, false]);
}

#[tokio::test]
async fn failures_down_the_route_come_back_as_502_with_the_reason() {
    let (_held, closed) = refusing_endpoint();
    let wrong_span = serve(AddOnePerLayer::new(40, 50)).await;
    let entry = serve(AddOnePerLayer::new(0, 10)).await;
    let cases = [
        (closed, "next_hop_unreachable", "unreachable"),
        (wrong_span, "next_hop_rejected", "layers_not_served"),
    ];
    for (next, code, needle) in cases {
        let route = vec![Hop::new(LayerSpan::new(10, 20), next).unwrap()];
        let err = client()
            .forward(&endpoint(&entry), frame((0, 10), route, 2), Encoding::Zstd)
            .await
            .unwrap_err();
        match err {
            ClientError::Rejected {
                status,
                code: got,
                message,
                peer_wire_version,
                ..
            } => {
                assert_eq!(status, 502);
                assert_eq!(got, code);
                assert!(message.contains(needle), "{message}");
                assert_eq!(peer_wire_version.as_deref(), Some("1"));
            }
            other => panic!("expected a rejection, got {other}"),
        }
    }
}

/// A loopback URL that refuses connections for as long as the returned socket lives: its port is
/// bound, so no other test's server can be given it, but never listened on. (A port bound and then
/// freed can be handed to a server of a test running alongside, which then answers in its place.)
fn refusing_endpoint() -> (tokio::net::TcpSocket, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", socket.local_addr().unwrap());
    (socket, url)
}

/// The route `10-20@second, 20-30@third` after a first hop running 0..10.
fn two_more_hops(second: &str, third: &str) -> Vec<Hop> {
    vec![
        Hop::new(LayerSpan::new(10, 20), second.to_owned()).unwrap(),
        Hop::new(LayerSpan::new(20, 30), third.to_owned()).unwrap(),
    ]
}

#[tokio::test]
async fn a_dead_last_hop_is_named_at_the_entry_and_is_retryable() {
    let first = serve(AddOnePerLayer::new(0, 10)).await;
    let second = serve(AddOnePerLayer::new(10, 20)).await;
    let (_held, third) = refusing_endpoint();
    let sent = frame((0, 10), two_more_hops(&second, &third), 2);
    let err = client()
        .forward(&endpoint(&first), sent.clone(), Encoding::Zstd)
        .await
        .unwrap_err();
    // The first hop answered...
    assert!(
        matches!(&err, ClientError::Rejected { endpoint, status: 502, .. } if *endpoint == first),
        "{err}"
    );
    // ... but the failure is the third hop's.
    let failure = err.hop_failure().unwrap();
    assert_eq!(failure.endpoint, third, "{failure}");
    assert_eq!(failure.kind, HopFailureKind::Unreachable, "{failure}");
    assert_eq!(failure.code(), "unreachable");
    assert_eq!(failure.status(), None);
    assert_eq!(failure.reported_by.as_deref(), Some(first.as_str()));
    assert!(failure.retryable(), "{failure}");
    assert!(err.retryable());
    assert!(failure.to_string().contains(&third), "{failure}");

    // On the wire: the first hop's error body names the third hop.
    let encoded = sent.encode(Encoding::Raw);
    let response = reqwest::Client::new()
        .post(format!("{first}/forward"))
        .headers(encoded.headers)
        .body(encoded.body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: ErrorBody = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(body.error.code, "next_hop_rejected");
    let named = body.error.failed_hop.unwrap();
    assert_eq!(
        (named.endpoint.as_str(), named.code(), named.status()),
        (third.as_str(), "unreachable", None)
    );
}

#[tokio::test]
async fn a_hop_that_refuses_the_frame_is_named_and_final() {
    let first = serve(AddOnePerLayer::new(0, 10)).await;
    let second = serve(AddOnePerLayer::new(10, 20)).await;
    // Asked for 20..30, serves 40..50: 409 layers_not_served.
    let third = serve(AddOnePerLayer::new(40, 50)).await;
    let err = client()
        .forward(
            &endpoint(&first),
            frame((0, 10), two_more_hops(&second, &third), 2),
            Encoding::Zstd,
        )
        .await
        .unwrap_err();
    let failure = err.hop_failure().unwrap();
    assert_eq!(failure.endpoint, third, "{failure}");
    assert_eq!(
        (failure.status(), failure.code()),
        (Some(409), "layers_not_served"),
        "{failure}"
    );
    assert!(failure.message.contains("not served"), "{failure}");
    assert!(!failure.retryable(), "{failure}");
    assert!(!err.retryable());

    // The first hop itself refusing: the failure is its own, and final too.
    let err = client()
        .forward(&endpoint(&third), frame((0, 10), vec![], 2), Encoding::Raw)
        .await
        .unwrap_err();
    let failure = err.hop_failure().unwrap();
    assert_eq!(
        (failure.endpoint.as_str(), failure.status(), failure.code()),
        (third.as_str(), Some(409), "layers_not_served")
    );
    assert_eq!(failure.reported_by, None);
    assert!(!err.retryable());
}

#[tokio::test]
async fn an_overloaded_last_hop_is_named_with_its_code_and_is_retryable() {
    let first = serve(AddOnePerLayer::new(0, 10)).await;
    let second = serve(AddOnePerLayer::new(10, 20)).await;
    let third = serve(Arc::new(AddOnePerLayer {
        serves: LayerSpan::new(20, 30),
        overloaded: true,
        calls: Mutex::new(Vec::new()),
        rewinds: Mutex::new(Vec::new()),
    }))
    .await;
    let err = client()
        .forward(
            &endpoint(&first),
            frame((0, 10), two_more_hops(&second, &third), 2),
            Encoding::Zstd,
        )
        .await
        .unwrap_err();
    let failure = err.hop_failure().unwrap();
    assert_eq!(
        (failure.endpoint.as_str(), failure.status(), failure.code()),
        (third.as_str(), Some(503), "overloaded")
    );
    assert!(failure.retryable(), "{failure}");
}

#[tokio::test]
async fn the_client_reports_a_dead_peer_and_a_bad_endpoint() {
    let (_held, closed) = refusing_endpoint();
    let err = client()
        .forward(&endpoint(&closed), frame((0, 1), vec![], 1), Encoding::Raw)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unreachable { .. }), "{err}");
    // Text that names no endpoint is refused where it is parsed; a URL the HTTP client cannot
    // use (its port out of range) is refused by the client.
    assert!(
        "peer-without-scheme"
            .parse::<meshnet_wire::Endpoint>()
            .is_err()
    );
    let err = client()
        .forward(
            &endpoint("http://peer:99999"),
            frame((0, 1), vec![], 1),
            Encoding::Raw,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::InvalidEndpoint { .. }), "{err}");
}

#[tokio::test]
async fn an_oversized_content_length_is_refused_before_the_body_is_read() {
    let url = serve(AddOnePerLayer::new(0, 10)).await;
    let encoded = frame((0, 10), vec![], 4).encode(Encoding::Raw);
    // 4 MiB against a limit of about 1 MiB: refused on the declared length alone.
    let response = reqwest::Client::new()
        .post(format!("{url}/forward"))
        .headers(encoded.headers)
        .body(vec![0u8; 4 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(response.headers()[WIRE_VERSION_HEADER], "1");
    let error: ErrorBody = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(error.error.code, "body_too_large");
    assert!(
        error.error.message.contains("4194304"),
        "{}",
        error.error.message
    );
}

#[tokio::test]
async fn a_next_hop_that_accepts_and_never_answers_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = format!("http://{}", listener.local_addr().unwrap());
    // Accepts connections and holds them open without reading or answering.
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            held.push(socket);
        }
    });
    let client = ForwardClient::new(limits(), Duration::from_millis(300)).unwrap();
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        client.forward(&endpoint(&silent), frame((0, 1), vec![], 1), Encoding::Raw),
    )
    .await
    .expect("the client's own timeout never fired")
    .unwrap_err();
    holder.abort();
    match &err {
        ClientError::Timeout { endpoint, timeout } => {
            assert_eq!(endpoint, &silent);
            assert_eq!(*timeout, Duration::from_millis(300));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(err.code(), "next_hop_timeout");
    assert!(err.retryable(), "{err}");
    let failure = err.hop_failure().unwrap();
    assert_eq!(failure.kind, HopFailureKind::Timeout);
    assert_eq!(failure.endpoint, silent);
    assert!(failure.retryable(), "{failure}");
}

/// Opens in-memory streams to a peer served by `router`; the first `drop_first` of them are
/// dropped unread on the receiving side, as libp2p-stream drops an inbound stream it has no
/// room for.
struct DroppingOpener {
    router: axum::Router,
    drop_first: usize,
    opened: Mutex<usize>,
}

impl meshnet_node::stream::StreamOpener for DroppingOpener {
    fn open(&self, _peer: &str) -> meshnet_node::stream::OpenFuture {
        let dropped = {
            let mut opened = self.opened.lock().unwrap();
            *opened += 1;
            *opened <= self.drop_first
        };
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        if dropped {
            drop(theirs);
        } else {
            tokio::spawn(meshnet_node::stream::serve_stream(
                theirs,
                self.router.clone(),
            ));
        }
        Box::pin(async move {
            Ok(meshnet_node::stream::OpenedStream {
                io: Box::new(ours),
                path: meshnet_metrics::HopPath::Relayed,
            })
        })
    }
}

#[tokio::test]
async fn a_stream_dropped_unread_is_sent_again_on_a_new_one() {
    let peer = "12D3KooWGzsVqE4qHZPh3mU5Z7wYkqH2yZbnvQbmz1Xx8W3Jx3bC";
    for (drop_first, answered) in [(0, true), (2, true), (4, true), (5, false)] {
        let executor = AddOnePerLayer::new(0, 10);
        let opener = Arc::new(DroppingOpener {
            router: plane(executor.clone()).router(),
            drop_first,
            opened: Mutex::new(0),
        });
        let client = client().with_streams(opener.clone());
        let sent = frame((0, 10), vec![], 3);
        let outcome = client
            .forward(
                &meshnet_wire::Endpoint::Peer(peer.into()),
                sent.clone(),
                Encoding::Raw,
            )
            .await;
        let opened = *opener.opened.lock().unwrap();
        if answered {
            let answer = outcome.unwrap();
            assert_eq!(answer.activations.values(), shifted(&sent, 10.0).as_slice());
            assert_eq!(opened, drop_first + 1);
            assert_eq!(executor.calls.lock().unwrap().len(), 1);
        } else {
            // Five streams, all dropped: the hop is unreachable, and nothing ran.
            assert!(
                matches!(outcome, Err(ClientError::Unreachable { .. })),
                "{outcome:?}"
            );
            assert_eq!(opened, 5);
            assert!(executor.calls.lock().unwrap().is_empty());
        }
    }
}

/// The endpoint a URL names.
fn endpoint(url: &str) -> meshnet_wire::Endpoint {
    url.parse().expect("an http:// URL")
}

/// Starts an entry that awaits outputs on `desk` (and serves no layers) on a free loopback
/// port, and returns its base URL.
async fn serve_entry(desk: Arc<ReturnDesk>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = plane(AddOnePerLayer::new(0, 0)).with_returns(desk).router();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// `frame` with the return address of `awaited` at `entry`.
fn returning(mut frame: ActivationFrame, entry: &str, awaited: &AwaitedReturn) -> ActivationFrame {
    frame.meta.return_to = Some(ReturnAddress {
        endpoint: endpoint(entry),
        ticket: awaited.ticket(),
    });
    frame
}

#[tokio::test]
async fn the_last_hop_returns_the_output_straight_to_the_entry() {
    let desk = ReturnDesk::new(16);
    let entry = serve_entry(Arc::clone(&desk)).await;
    let a = serve(AddOnePerLayer::new(0, 10)).await;
    let b = serve(AddOnePerLayer::new(10, 20)).await;
    let c = serve(AddOnePerLayer::new(20, 30)).await;
    for encoding in [Encoding::Raw, Encoding::Zstd] {
        let plain = frame((0, 10), two_more_hops(&b, &c), 130);
        let mut awaited = desk.expect(&plain.meta).unwrap();
        let sent = returning(plain.clone(), &entry, &awaited);
        let delivery = client()
            .forward_delivering(&endpoint(&a), sent, encoding)
            .await
            .unwrap();
        assert_eq!(delivery, Delivery::ReturnedDirectly);
        let returned = awaited.received().await.unwrap();
        assert_eq!(returned.meta.session, plain.meta.session);
        assert_eq!(returned.meta.position, 128);
        assert_eq!(returned.meta.return_to, None);
        assert_eq!(
            returned.activations.values(),
            shifted(&plain, 30.0).as_slice()
        );
        drop(awaited);
        assert_eq!(desk.awaited(), 0);
    }
}

#[tokio::test]
async fn an_unreachable_entry_gets_the_output_back_along_the_route() {
    let desk = ReturnDesk::new(16);
    let (_held, closed) = refusing_endpoint();
    let a = serve(AddOnePerLayer::new(0, 10)).await;
    let b = serve(AddOnePerLayer::new(10, 20)).await;
    let c = serve(AddOnePerLayer::new(20, 30)).await;
    let plain = frame((0, 10), two_more_hops(&b, &c), 3);
    let awaited = desk.expect(&plain.meta).unwrap();
    let sent = returning(plain.clone(), &closed, &awaited);
    let delivery = client()
        .forward_delivering(&endpoint(&a), sent, Encoding::Zstd)
        .await
        .unwrap();
    let Delivery::Answered(answer) = delivery else {
        panic!("expected the answer along the route, got {delivery:?}");
    };
    assert_eq!(answer.meta.layers, LayerSpan::new(0, 30));
    assert_eq!(
        answer.activations.values(),
        shifted(&plain, 30.0).as_slice()
    );
}

/// Posts `frame` to `{entry}/return` with `ticket` (none when `None`) and returns the status
/// and error code.
async fn post_return(entry: &str, frame: &ActivationFrame, ticket: Option<&str>) -> (u16, String) {
    let encoded = frame.encode(Encoding::Raw);
    let mut request = reqwest::Client::new()
        .post(format!("{entry}/return"))
        .headers(encoded.headers)
        .body(encoded.body);
    if let Some(ticket) = ticket {
        request = request.header(meshnet_wire::return_address::RETURN_TICKET, ticket);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let body = response.bytes().await.unwrap();
    let code = serde_json::from_slice::<ErrorBody>(&body)
        .map(|error| error.error.code)
        .unwrap_or_default();
    (status, code)
}

#[tokio::test]
async fn a_stranger_cannot_inject_an_output() {
    let desk = ReturnDesk::new(16);
    let entry = serve_entry(Arc::clone(&desk)).await;
    let expected = frame((20, 30), vec![], 1);
    let mut awaited = desk.expect(&expected.meta).unwrap();
    let ticket = awaited.ticket().to_string();
    let mut other_session = expected.clone();
    other_session.meta.session = Uuid::new_v4();
    let mut other_position = expected.clone();
    other_position.meta.position += 1;
    let guessed = ReturnTicket::from_bits(7).to_string();
    let cases = [
        (None, &expected, 401, "return_ticket_missing"),
        (Some("not-hex"), &expected, 403, "return_refused"),
        (Some(guessed.as_str()), &expected, 403, "return_refused"),
        (Some(ticket.as_str()), &other_session, 403, "return_refused"),
        (
            Some(ticket.as_str()),
            &other_position,
            403,
            "return_refused",
        ),
    ];
    for (ticket, frame, status, code) in cases {
        assert_eq!(
            post_return(&entry, frame, ticket).await,
            (status, code.to_owned()),
            "ticket {ticket:?}"
        );
    }
    // None of those reached the generation; the real output still does, once.
    assert_eq!(post_return(&entry, &expected, Some(&ticket)).await.0, 204);
    assert_eq!(awaited.received().await, Some(expected.clone()));
    assert_eq!(
        post_return(&entry, &expected, Some(&ticket)).await,
        (403, "return_refused".to_owned())
    );
    // A member that awaits nothing refuses every return.
    let plain = serve(AddOnePerLayer::new(0, 10)).await;
    assert_eq!(
        post_return(&plain, &expected, Some(&ticket)).await,
        (403, "return_refused".to_owned())
    );
}

#[tokio::test]
async fn a_202_to_a_frame_without_a_return_address_is_a_mismatched_answer() {
    let desk = ReturnDesk::new(16);
    let entry = serve_entry(Arc::clone(&desk)).await;
    let a = serve(AddOnePerLayer::new(0, 10)).await;
    let b = serve(AddOnePerLayer::new(10, 20)).await;
    let c = serve(AddOnePerLayer::new(20, 30)).await;
    let plain = frame((0, 10), two_more_hops(&b, &c), 1);
    let awaited = desk.expect(&plain.meta).unwrap();
    let sent = returning(plain, &entry, &awaited);
    // `forward` expects the answer itself: word that it went elsewhere is an error.
    let error = client()
        .forward(&endpoint(&a), sent, Encoding::Raw)
        .await
        .unwrap_err();
    assert!(
        matches!(error, ClientError::MismatchedResponse { .. }),
        "{error}"
    );
}
