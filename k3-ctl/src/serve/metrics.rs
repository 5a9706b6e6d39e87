//! `GET /metrics`: Prometheus text exposition through `prometheus-client` (the Prometheus
//! project's Rust client), not hand-formatted.
//!
//! serve's own figures (`k3_serve_*`): requests by route and status, the queue and the jobs
//! running, ids (prompt, cached, generated), prefill and decode seconds, seconds per decoded id
//! and the last job's ids per second, weight bytes its jobs read, and their routed-expert
//! requests and TRUE resident hits. The store's (`k3_store_*`), read from it at each scrape: its
//! lifetime expert requests, resident hits, TRUE resident hit rate and bytes read, and its kept
//! sessions (`k3_store_up` is 0 when it did not answer).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use k3_proto::serve::{Timings, Usage};
use k3_proto::wire::StatsReport;

/// `exponential_buckets` rounded to 9 decimals, so the `le` labels read 0.009, not
/// 0.009000000000000001.
fn buckets(start: f64, factor: f64, n: u16) -> impl Iterator<Item = f64> {
    exponential_buckets(start, factor, n).map(|b| (b * 1e9).round() / 1e9)
}

/// A request's route and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteStatus {
    /// The route (`other` for unknown paths).
    pub route: String,
    /// The HTTP status code.
    pub status: u16,
}

/// Why a job was cancelled.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// `client_gone` or `stop_string`.
    pub reason: String,
}

/// serve's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered.
    pub requests: Family<RouteStatus, Counter>,
    /// Requests waiting for a job slot.
    pub queued: Gauge,
    /// Jobs running.
    pub running: Gauge,
    /// Connections open.
    pub connections: Gauge,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    completion_tokens: Counter,
    prefill_seconds: Histogram,
    decode_seconds: Counter<f64, AtomicU64>,
    seconds_per_token: Histogram,
    tokens_per_second: Gauge<f64, AtomicU64>,
    bytes_read: Counter,
    expert_requests: Counter,
    resident_hits: Counter,
    /// Jobs cancelled, by reason.
    pub cancelled: Family<Reason, Counter>,
    store: Arc<StoreSnapshot>,
}

/// The store's figures as read at the last scrape.
#[derive(Debug, Default)]
struct StoreSnapshot(Mutex<Option<StatsReport>>);

impl Collector for StoreSnapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snap = self.0.lock().map(|s| s.clone()).unwrap_or(None);
        let up = ConstGauge::new(i64::from(snap.is_some()));
        up.encode(enc.encode_descriptor(
            "k3_store_up",
            "1 when the store answered this scrape",
            None,
            up.metric_type(),
        )?)?;
        let Some(s) = snap else {
            return Ok(());
        };
        let l = &s.lifetime;
        for (name, help, v) in [
            (
                "k3_store_expert_requests",
                "Routed experts requested of the store since it started",
                l.requests,
            ),
            (
                "k3_store_resident_hits",
                "Requested experts already resident (TRUE resident hits)",
                l.resident_hits,
            ),
            (
                "k3_store_expert_bytes_read",
                "Bytes the store read for routed experts",
                l.expert_bytes_read,
            ),
            (
                "k3_store_trunk_bytes_read",
                "Bytes the store read for streamed trunk layers",
                l.trunk_bytes_read,
            ),
        ] {
            let c = ConstCounter::new(v);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let rate = ConstGauge::new(l.true_resident_hit_rate());
        rate.encode(enc.encode_descriptor(
            "k3_store_true_resident_hit_rate",
            "Resident hits over expert requests, since the store started",
            None,
            rate.metric_type(),
        )?)?;
        for (name, help, v) in [
            (
                "k3_store_sessions",
                "Conversations the store keeps",
                i64::from(s.sessions.count),
            ),
            (
                "k3_store_session_bytes",
                "Bytes of the kept conversations",
                i64::try_from(s.sessions.bytes).unwrap_or(i64::MAX),
            ),
            (
                "k3_store_workers",
                "Workers attached to the store",
                i64::from(s.workers),
            ),
        ] {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

impl Metrics {
    /// The registry with every metric.
    pub fn new(max_jobs: usize, queue: usize) -> Metrics {
        let mut r = Registry::default();
        /// Register a fresh metric of type `M` and return a handle to it.
        fn add<M: Default + Clone + prometheus_client::registry::Metric>(
            r: &mut Registry,
            name: &str,
            help: &str,
        ) -> M {
            let m = M::default();
            r.register(name, help, m.clone());
            m
        }
        let cap = |v: usize| ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
        r.register(
            "k3_serve_max_jobs",
            "Jobs that run at once (--max-jobs)",
            cap(max_jobs),
        );
        r.register(
            "k3_serve_queue_capacity",
            "Requests that may wait for a slot (--queue)",
            cap(queue),
        );
        let prefill_seconds = Histogram::new(buckets(0.01, 4.0, 12));
        r.register(
            "k3_serve_prefill_seconds",
            "Seconds of each job's prefill (with its first pick)",
            prefill_seconds.clone(),
        );
        let seconds_per_token = Histogram::new(buckets(0.001, 3.0, 14));
        r.register(
            "k3_serve_seconds_per_token",
            "Mean seconds per decoded id, one observation per job",
            seconds_per_token.clone(),
        );
        let store = Arc::new(StoreSnapshot::default());
        r.register_collector(Box::new(SharedCollector(store.clone())));
        Metrics {
            requests: add(
                &mut r,
                "k3_serve_requests",
                "HTTP requests answered, by route and status",
            ),
            queued: add(&mut r, "k3_serve_queued", "Requests waiting for a job slot"),
            running: add(&mut r, "k3_serve_running", "Jobs running"),
            connections: add(&mut r, "k3_serve_connections", "HTTP connections open"),
            prompt_tokens: add(
                &mut r,
                "k3_serve_prompt_tokens",
                "Prompt ids of finished jobs",
            ),
            cached_tokens: add(
                &mut r,
                "k3_serve_cached_tokens",
                "Prompt ids a kept session already held (not prefilled again)",
            ),
            completion_tokens: add(&mut r, "k3_serve_completion_tokens", "Ids generated"),
            decode_seconds: add(
                &mut r,
                "k3_serve_decode_seconds",
                "Seconds of decode steps (after the first id)",
            ),
            tokens_per_second: add(
                &mut r,
                "k3_serve_tokens_per_second",
                "Decoded ids per second of the last job that decoded",
            ),
            bytes_read: add(
                &mut r,
                "k3_serve_bytes_read",
                "Weight bytes read for serve's jobs (trunk and experts)",
            ),
            expert_requests: add(
                &mut r,
                "k3_serve_expert_requests",
                "Routed experts serve's jobs requested",
            ),
            resident_hits: add(
                &mut r,
                "k3_serve_resident_hits",
                "Of those, already resident (TRUE resident hits)",
            ),
            cancelled: add(
                &mut r,
                "k3_serve_cancelled",
                "Jobs cancelled before their end, by reason",
            ),
            prefill_seconds,
            seconds_per_token,
            store,
            registry: r,
        }
    }

    /// A finished (or cancelled) job's figures: one choice's; `prompt`: the job's prompt too (its first
    /// choice: a job of `n` choices prefills its prompt once).
    pub fn job(&self, usage: &Usage, t: &Timings, prompt: bool) {
        if prompt {
            self.prompt_tokens.inc_by(u64::from(usage.prompt_ids));
            self.cached_tokens.inc_by(u64::from(usage.cached_ids));
            self.prefill_seconds.observe(t.prefill_seconds);
        }
        self.completion_tokens.inc_by(u64::from(usage.generated));
        self.decode_seconds.inc_by(t.decode_seconds);
        let decoded = usage.generated.saturating_sub(1);
        if decoded > 0 && t.decode_seconds > 0.0 {
            let spt = t.decode_seconds / f64::from(decoded);
            self.seconds_per_token.observe(spt);
            self.tokens_per_second.set(1.0 / spt);
        }
        self.bytes_read.inc_by(t.bytes_read);
        self.expert_requests.inc_by(t.expert_requests);
        self.resident_hits.inc_by(t.resident_hits);
    }

    /// A job cancelled for `reason`.
    pub fn cancel(&self, reason: &str) {
        self.cancelled
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The exposition, with the store's figures `store` (None: it did not answer).
    pub fn render(&self, store: Option<StatsReport>) -> Result<String, std::fmt::Error> {
        if let Ok(mut s) = self.store.0.lock() {
            *s = store;
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// The registry owns its collectors; this one shares the snapshot with [`Metrics`].
#[derive(Debug)]
struct SharedCollector(Arc<StoreSnapshot>);

impl Collector for SharedCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_jobs_figures_and_the_stores() {
        let m = Metrics::new(2, 8);
        m.requests
            .get_or_create(&RouteStatus {
                route: "/v1/completions".into(),
                status: 200,
            })
            .inc();
        let usage = Usage {
            prompt_ids: 10,
            cached_ids: 4,
            generated: 5,
        };
        let timings = Timings {
            prefill_seconds: 0.5,
            decode_seconds: 2.0,
            bytes_read: 1000,
            expert_requests: 8,
            resident_hits: 6,
            kept_session_bytes: None,
        };
        m.job(&usage, &timings, true);
        // A second choice of the same job: its ids count, its prompt (prefilled once) does not.
        m.job(&usage, &timings, false);
        let text = m.render(None).unwrap();
        assert!(text.contains("k3_serve_prompt_tokens_total 10"), "{text}");
        assert!(
            text.contains("k3_serve_completion_tokens_total 10"),
            "{text}"
        );
        assert!(
            text.contains("k3_serve_requests_total{route=\"/v1/completions\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(text.contains("k3_serve_cached_tokens_total 4"), "{text}");
        assert!(text.contains("k3_serve_tokens_per_second 2.0"), "{text}");
        // Bucket bounds as written, not float noise (0.009000000000000001).
        assert!(
            text.contains("k3_serve_seconds_per_token_bucket{le=\"0.009\"}"),
            "{text}"
        );
        assert!(!text.contains("00000000"), "{text}");
        assert!(text.contains("k3_store_up 0"), "{text}");
        assert!(!text.contains("k3_store_sessions"), "{text}");
        let mut s = StatsReport::default();
        s.lifetime.requests = 4;
        s.lifetime.resident_hits = 3;
        s.sessions.count = 2;
        let text = m.render(Some(s)).unwrap();
        assert!(
            text.contains("k3_store_true_resident_hit_rate 0.75"),
            "{text}"
        );
        assert!(text.contains("k3_store_sessions 2"), "{text}");
        assert!(text.contains("k3_store_expert_requests_total 4"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
