//! The connections under the router: hyper's HTTP/1 server driven by an accept loop of the
//! server's own, so that a client cannot hold the server with connections that send nothing.
//!
//! A connection is idle (no request yet, or between requests), reading a request's head (from
//! its first byte), or busy (a request in flight and its response not yet sent). An idle
//! connection is closed after the keep-alive timeout, a head must arrive whole within the
//! header timeout, and the handler bounds the body's read
//! ([`ConnectionLimits::body_read_timeout`]). At the connection cap a new connection evicts
//! the one idle longest: sockets that send nothing are what gets dropped, and `/health` and
//! real clients still get in.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::Request;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

/// How long a client may take, and how many connections it may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// From a request's first byte to the end of its head.
    pub header_read_timeout: Duration,
    /// From the head's end to the end of the body.
    pub body_read_timeout: Duration,
    /// How long a connection may sit without a request: a new one before its first byte, a
    /// kept-alive one after its last response.
    pub keep_alive_timeout: Duration,
    /// Open connections at most (lowered to what the open-file limit allows).
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

/// File descriptors left for everything but connections: the model's files, the runtime's
/// polls and pipes, a tensor-parallel group's pipes.
const RESERVED_FILES: usize = 64;

impl ConnectionLimits {
    /// The cap the open-file limit allows: above it `accept` fails (EMFILE) and no connection
    /// gets in, `/health`'s included, while the idle ones that filled the table stay.
    pub fn effective_max_connections(&self) -> usize {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
            || limit.rlim_cur == libc::RLIM_INFINITY
        {
            return self.max_connections;
        }
        let files = usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX);
        self.max_connections
            .min(files.saturating_sub(RESERVED_FILES).max(1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    ReadingHead,
    Busy,
}

struct Activity {
    phase: Phase,
    since: Instant,
    requests_in_flight: usize,
    /// The connection task, woken when the connection turns idle so its read arms the
    /// keep-alive deadline.
    reader: Option<Waker>,
}

/// One connection's state, shared by its socket, its requests and the cap.
struct Connection {
    activity: Mutex<Activity>,
    evicted: Notify,
}

impl Connection {
    fn new() -> Self {
        Self {
            activity: Mutex::new(Activity {
                phase: Phase::Idle,
                since: Instant::now(),
                requests_in_flight: 0,
                reader: None,
            }),
            evicted: Notify::new(),
        }
    }

    fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        // The state is a few plain fields, consistent after any panic.
        self.activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bytes_arrived(&self) {
        let mut activity = self.activity();
        if activity.phase == Phase::Idle {
            activity.phase = Phase::ReadingHead;
            activity.since = Instant::now();
        }
    }

    /// When a read waiting now must give up, and why; `None` while a request is in flight.
    fn read_deadline(
        &self,
        limits: &ConnectionLimits,
        reader: &Waker,
    ) -> Option<(Instant, &'static str)> {
        let mut activity = self.activity();
        match &activity.reader {
            Some(waker) if waker.will_wake(reader) => {}
            _ => activity.reader = Some(reader.clone()),
        }
        match activity.phase {
            Phase::Idle => Some((
                activity.since + limits.keep_alive_timeout,
                "the connection was idle past the keep-alive timeout",
            )),
            Phase::ReadingHead => Some((
                activity.since + limits.header_read_timeout,
                "the request head did not arrive within the header read timeout",
            )),
            Phase::Busy => None,
        }
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        let mut activity = self.activity();
        activity.requests_in_flight += 1;
        activity.phase = Phase::Busy;
        InFlight(self.clone())
    }

    /// Since when the connection has had no request in flight, if it has none.
    fn idle_since(&self) -> Option<Instant> {
        let activity = self.activity();
        (activity.phase != Phase::Busy).then_some(activity.since)
    }
}

/// A request in flight on its connection, until its response has been sent (or abandoned).
struct InFlight(Arc<Connection>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut activity = self.0.activity();
        activity.requests_in_flight -= 1;
        if activity.requests_in_flight == 0 {
            activity.phase = Phase::Idle;
            activity.since = Instant::now();
            if let Some(reader) = activity.reader.take() {
                reader.wake();
            }
        }
    }
}

/// A response body that keeps its request in flight until it is sent or dropped.
struct InFlightBody {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for InFlightBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A socket whose reads fail once the connection's deadline passes (a header or keep-alive
/// timeout); hyper then closes the connection.
struct TimedStream {
    stream: TcpStream,
    connection: Arc<Connection>,
    limits: ConnectionLimits,
    timer: Pin<Box<Sleep>>,
    armed_for: Option<Instant>,
}

impl TimedStream {
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some((deadline, why)) = self.connection.read_deadline(&self.limits, cx.waker()) else {
            return Poll::Pending;
        };
        if self.armed_for != Some(deadline) {
            self.timer.as_mut().reset(deadline);
            self.armed_for = Some(deadline);
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for TimedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.connection.bytes_arrived();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_deadline(cx),
        }
    }
}

impl AsyncWrite for TimedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

struct Slot {
    connection: Arc<Connection>,
    evicted: bool,
}

/// The open connections, within the cap.
pub struct Connections {
    slots: Mutex<(u64, HashMap<u64, Slot>)>,
    open: watch::Sender<usize>,
    max: usize,
}

/// A connection's place among the open ones, given back when its task ends.
struct Admitted {
    id: u64,
    connection: Arc<Connection>,
    connections: Arc<Connections>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut slots = self.connections.slots();
        slots.1.remove(&self.id);
        self.connections.open.send_replace(slots.1.len());
    }
}

impl Connections {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::new((0, HashMap::new())),
            open: watch::Sender::new(0),
            max: max.max(1),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, (u64, HashMap<u64, Slot>)> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection: at the cap, the connection idle longest is evicted for
    /// it; `None` when every connection has a request in flight.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let mut slots = self.slots();
        let (next_id, open) = &mut *slots;
        let staying = open.values().filter(|slot| !slot.evicted).count();
        if staying >= self.max {
            let (_, oldest) = open
                .values_mut()
                .filter(|slot| !slot.evicted)
                .filter_map(|slot| Some((slot.connection.idle_since()?, slot)))
                .min_by_key(|(since, _)| *since)?;
            oldest.evicted = true;
            oldest.connection.evicted.notify_one();
        }
        let id = *next_id;
        *next_id += 1;
        let connection = Arc::new(Connection::new());
        open.insert(
            id,
            Slot {
                connection: connection.clone(),
                evicted: false,
            },
        );
        self.open.send_replace(open.len());
        Some(Admitted {
            id,
            connection,
            connections: self.clone(),
        })
    }

    /// Completes once no connection is open.
    pub async fn all_closed(&self) {
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|&n| n == 0).await;
    }
}

/// Accepts connections and serves `router` on each until dropped. Once `draining` turns true,
/// open connections finish their request in flight and close, and new ones are served one
/// request each (so `/health` keeps answering 503 through the drain).
pub async fn accept_loop(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    connections: Arc<Connections>,
    draining: watch::Receiver<bool>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of file descriptors, or a client that left before its accept: retrying
                // at once would spin on the same error.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        // Dropping the socket refuses it: every open connection is in a request.
        let Some(admitted) = connections.admit() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            admitted,
            router.clone(),
            limits,
            draining.clone(),
        ));
    }
}

async fn serve_connection(
    stream: TcpStream,
    admitted: Admitted,
    router: Router,
    limits: ConnectionLimits,
    mut draining: watch::Receiver<bool>,
) {
    let connection = admitted.connection.clone();
    let io = TokioIo::new(TimedStream {
        stream,
        connection: connection.clone(),
        limits,
        timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
        armed_for: None,
    });
    let service = hyper::service::service_fn({
        let connection = connection.clone();
        move |request: Request<Incoming>| {
            let in_flight = connection.request_started();
            let response = router.clone().oneshot(request);
            async move {
                let response = response.await.unwrap_or_else(|never| match never {});
                Ok::<_, Infallible>(response.map(|body| InFlightBody {
                    body,
                    _in_flight: in_flight,
                }))
            }
        }
    });
    let accepted_while_draining = *draining.borrow_and_update();
    let served = http1::Builder::new()
        .keep_alive(!accepted_while_draining)
        .serve_connection(io, service);
    tokio::pin!(served);
    if accepted_while_draining {
        let _ = served.await;
        return;
    }
    tokio::select! {
        _ = served.as_mut() => return,
        _ = connection.evicted.notified() => return,
        Ok(_) = draining.wait_for(|&draining| draining) => {}
    }
    served.as_mut().graceful_shutdown();
    let _ = served.await;
}
