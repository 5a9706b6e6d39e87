//! What wraps every request: its id (`X-Request-Id`, accepted from the client when sane, else
//! made here; on every log line of the request through a `tracing` span and on the answer),
//! CORS (off unless `--cors-origin`; a preflight `OPTIONS` from an allowed origin is answered
//! 204), the API key (`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`, compared in
//! constant time; 401 otherwise, in Anthropic's error shape on its routes; `GET /health` and
//! preflights need none), the access log line and the request counter. Before any of that,
//! the message's framing (RFC 9112): a head with both `Content-Length` and `Transfer-Encoding`
//! is 400 and the connection closes (§6.1, the request-smuggling case); a body in a
//! `Content-Encoding` other than `identity` is 415 (nothing here decodes one). Both in the
//! error shape of the route (Anthropic's on its routes).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tracing::Instrument;

use super::api::ApiError;
use super::conn::Conn;
use super::metrics::Metrics;
use super::metrics::RouteStatus;

/// Longest client-given request id kept.
const MAX_ID: usize = 64;

/// Who may call.
#[derive(Debug, Default)]
pub struct Policy {
    /// The API key (`None`: no key asked).
    pub api_key: Option<Vec<u8>>,
    /// Origins a browser may call from (`--cors-origin`; empty: CORS off).
    pub cors_origins: Vec<String>,
}

/// What a handler knows of its request.
#[derive(Clone, Debug)]
pub struct Ctx {
    /// The request id.
    pub id: String,
    /// The route (a known path, or `other`).
    pub route: String,
    /// The connection it arrived on.
    pub conn: Option<Arc<Conn>>,
}

/// A client's `X-Request-Id` when it is 1–64 characters of `[A-Za-z0-9._:-]`.
fn sane_id(h: &HeaderMap) -> Option<String> {
    let v = h.get("x-request-id")?.to_str().ok()?;
    let ok = !v.is_empty()
        && v.len() <= MAX_ID
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    ok.then(|| v.to_string())
}

fn new_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    format!("req-{:x}-{:x}{n:x}", std::process::id(), t & 0xff_ffff_ffff)
}

/// The route label of a path.
fn route_of(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    }
}

/// The key in `Authorization: Bearer KEY` or `x-api-key: KEY` equals `key` (constant time in
/// the key's bytes).
fn authorized(h: &HeaderMap, key: &[u8]) -> bool {
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok());
    [bearer, x_api_key]
        .into_iter()
        .flatten()
        .any(|given| given.as_bytes().ct_eq(key).into())
}

fn allowed_origin<'a>(p: &'a Policy, h: &HeaderMap) -> Option<&'a str> {
    let origin = h.get(header::ORIGIN)?.to_str().ok()?;
    p.cors_origins
        .iter()
        .find(|o| o.as_str() == origin || o.as_str() == "*")
        .map(|o| if o == "*" { "*" } else { o.as_str() })
}

fn cors_headers(r: &mut Response, origin: &str) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, retry-after"),
    );
}

/// The preflight's answer: 204 with what may be sent, or 403 for an origin not allowed.
fn preflight(p: &Policy, h: &HeaderMap) -> Response {
    let Some(origin) = allowed_origin(p, h) else {
        return ApiError::status(
            StatusCode::FORBIDDEN,
            "cors_origin_not_allowed",
            "this origin may not call this server (k3-ctl serve --cors-origin ORIGIN)",
        )
        .into_response();
    };
    let mut r = StatusCode::NO_CONTENT.into_response();
    cors_headers(&mut r, origin);
    let hs = r.headers_mut();
    hs.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    hs.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(
            "authorization, content-type, x-request-id, x-api-key, anthropic-version, anthropic-beta",
        ),
    );
    hs.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    r
}

/// A message this server does not read as sent: its framing conflicts, or its body is
/// encoded.
fn framing_error(req: &Request) -> Option<ApiError> {
    let conn = req.extensions().get::<Arc<Conn>>();
    if conn
        .and_then(|c| c.framing())
        .is_some_and(|f| f.conflicts())
    {
        let mut e = ApiError::status(
            StatusCode::BAD_REQUEST,
            "bad_framing",
            "the request has both Content-Length and Transfer-Encoding (RFC 9112 §6.1): send \
             one of them",
        );
        e.close = true;
        return Some(e);
    }
    let encodings = req.headers().get_all(header::CONTENT_ENCODING);
    let coded = encodings.iter().find_map(|v| {
        let v = v.to_str().unwrap_or("?");
        v.split(',')
            .map(str::trim)
            .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"))
            .map(str::to_string)
    });
    coded.map(|c| {
        ApiError::status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_encoding",
            format!("Content-Encoding {c:?} is not supported: send the body uncompressed"),
        )
    })
}

/// `e` in the error shape of `route`.
fn shaped(route: &str, e: ApiError) -> Response {
    if route.starts_with("/v1/messages") {
        super::anthropic::error_response(e)
    } else {
        e.into_response()
    }
}

/// What the middleware needs of the server's state: the API key and CORS policy, and the
/// metrics it counts every answer in.
pub trait Guarded: Send + Sync + 'static {
    /// The API key and the CORS origins.
    fn policy(&self) -> &Policy;
    /// The metrics.
    fn metrics(&self) -> &Metrics;
}

/// `routes` wrapped in the middleware.
pub fn layers<S: Guarded>(routes: axum::Router, st: Arc<S>) -> axum::Router {
    routes.layer(axum::middleware::from_fn_with_state(st, layer::<S>))
}

/// The middleware (see the module doc).
pub async fn layer<S: Guarded>(State(st): State<Arc<S>>, mut req: Request, next: Next) -> Response {
    let id = sane_id(req.headers()).unwrap_or_else(new_id);
    let route = route_of(req.uri().path());
    let span = tracing::info_span!("request", id = %id);
    let t0 = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let origin = allowed_origin(st.policy(), req.headers()).map(str::to_string);
    async move {
        let policy = st.policy();
        let mut r = if let Some(e) = framing_error(&req) {
            let mut r = shaped(route, e);
            if r.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE {
                r.headers_mut().insert(
                    header::ACCEPT_ENCODING,
                    HeaderValue::from_static("identity"),
                );
            }
            r
        } else if method == Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            preflight(policy, req.headers())
        } else if policy
            .api_key
            .as_deref()
            .is_some_and(|k| route != "/health" && !authorized(req.headers(), k))
        {
            let e = ApiError::status(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "a valid API key is required: Authorization: Bearer KEY, or x-api-key: KEY",
            );
            let mut r = shaped(route, e);
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        } else {
            let conn = req.extensions().get::<Arc<Conn>>().cloned();
            req.extensions_mut().insert(Ctx {
                id: id.clone(),
                route: route.to_string(),
                conn,
            });
            next.run(req).await
        };
        if let Some(o) = &origin {
            cors_headers(&mut r, o);
        }
        if let Ok(v) = HeaderValue::from_str(&id) {
            r.headers_mut().insert("x-request-id", v);
        }
        let status = r.status().as_u16();
        st.metrics()
            .requests
            .get_or_create(&RouteStatus {
                route: route.to_string(),
                status,
            })
            .inc();
        if is_event_stream(&r) {
            // The head goes out now, the events as the job makes them: the request is logged
            // again when its stream ends (or the client leaves), with its whole time.
            tracing::info!(
                "{method} {path} -> {status}, streaming (head after {:.3} s)",
                t0.elapsed().as_secs_f64()
            );
            let end = StreamEnd {
                line: format!("{method} {path} -> {status}"),
                t0,
                span: tracing::Span::current(),
            };
            return r.map(|b| {
                axum::body::Body::new(http_body_util::BodyExt::map_frame(b, move |f| {
                    end.frame();
                    f
                }))
            });
        }
        tracing::info!(
            "{method} {path} -> {status} in {:.3} s",
            t0.elapsed().as_secs_f64()
        );
        r
    }
    .instrument(span)
    .await
}

/// Whether `r` is a server-sent event stream (its body outlives the handler).
fn is_event_stream(r: &Response) -> bool {
    r.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Logs a streamed request's end when its body is dropped: sent whole, or its client gone.
struct StreamEnd {
    line: String,
    t0: Instant,
    span: tracing::Span,
}

impl StreamEnd {
    /// Called per frame: keeps the guard inside the body's closure.
    fn frame(&self) {}
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        let _in = self.span.enter();
        tracing::info!(
            "{} in {:.3} s (stream ended)",
            self.line,
            self.t0.elapsed().as_secs_f64()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn request_ids_are_kept_when_sane() {
        assert_eq!(
            sane_id(&headers(&[("x-request-id", "abc-1.2:3_x")])).as_deref(),
            Some("abc-1.2:3_x")
        );
        assert_eq!(sane_id(&headers(&[("x-request-id", "a b")])), None);
        assert_eq!(
            sane_id(&headers(&[("x-request-id", &"x".repeat(65))])),
            None
        );
        assert_ne!(new_id(), new_id());
    }

    #[test]
    fn bearer_keys_and_origins() {
        let k = b"s3cret".as_slice();
        assert!(authorized(
            &headers(&[("authorization", "Bearer s3cret")]),
            k
        ));
        for bad in ["Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"] {
            assert!(!authorized(&headers(&[("authorization", bad)]), k), "{bad}");
        }
        assert!(authorized(&headers(&[("x-api-key", "s3cret")]), k));
        for bad in ["s3cre", "Bearer s3cret", ""] {
            assert!(!authorized(&headers(&[("x-api-key", bad)]), k), "{bad}");
        }
        assert!(authorized(
            &headers(&[("x-api-key", "wrong"), ("authorization", "Bearer s3cret")]),
            k
        ));
        assert!(!authorized(&HeaderMap::new(), k));
        let p = Policy {
            api_key: None,
            cors_origins: vec!["https://app.example".into()],
        };
        assert_eq!(
            allowed_origin(&p, &headers(&[("origin", "https://app.example")])),
            Some("https://app.example")
        );
        assert_eq!(
            allowed_origin(&p, &headers(&[("origin", "https://evil.example")])),
            None
        );
        assert_eq!(
            allowed_origin(
                &Policy::default(),
                &headers(&[("origin", "https://app.example")])
            ),
            None
        );
    }
}
