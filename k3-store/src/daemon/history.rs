//! The store's history of earlier jobs' token streams, the corpus of history drafting
//! (SPEC.md §3.12). Bounded by ids kept: the oldest streams are dropped first. A draft query scans
//! the streams newest first for the longest suffix match (`k3_proto::draft::lookup`), so its cost
//! is linear in the ids kept (about a millisecond per million ids, against seconds per token).

use std::collections::VecDeque;

use k3_proto::draft;
use k3_proto::wire::HistoryStats;

/// Default bound on ids kept (4 MiB of ids).
pub const DEFAULT_HISTORY_TOKENS: usize = 1 << 20;

/// Earlier jobs' token streams, newest last.
#[derive(Debug)]
pub struct History {
    streams: VecDeque<Vec<u32>>,
    tokens: usize,
    capacity: usize,
    queries: u64,
    hits: u64,
    drafted: u64,
}

impl History {
    /// An empty history keeping at most `capacity` ids (0 keeps nothing).
    pub fn new(capacity: usize) -> History {
        History {
            streams: VecDeque::new(),
            tokens: 0,
            capacity,
            queries: 0,
            hits: 0,
            drafted: 0,
        }
    }

    /// Add a stream (its newest `capacity` ids at most), dropping the oldest streams to stay in
    /// bounds. Streams too short to ever match are not kept.
    pub fn record(&mut self, ids: &[u32]) {
        let ids = &ids[ids.len().saturating_sub(self.capacity)..];
        if ids.len() <= draft::MIN_MATCH {
            return;
        }
        while self.tokens + ids.len() > self.capacity {
            match self.streams.pop_front() {
                Some(old) => self.tokens -= old.len(),
                None => return,
            }
        }
        self.tokens += ids.len();
        self.streams.push_back(ids.to_vec());
    }

    /// Up to `max` ids following the longest suffix of `context` found in a stream (the longest
    /// match over all streams; among equals, the newest stream).
    pub fn draft(&mut self, context: &[u32], max: usize) -> Vec<u32> {
        self.queries += 1;
        let mut best: Option<(usize, &[u32])> = None;
        for s in self.streams.iter().rev() {
            if let Some((m, cont)) = draft::lookup(s, context, max) {
                if best.is_none_or(|(bm, _)| m > bm) {
                    best = Some((m, cont));
                }
            }
        }
        let out = best.map(|(_, c)| c.to_vec()).unwrap_or_default();
        if !out.is_empty() {
            self.hits += 1;
            self.drafted += out.len() as u64;
        }
        out
    }

    /// Counters for `k3-ctl stats`.
    pub fn stats(&self) -> HistoryStats {
        HistoryStats {
            streams: self.streams.len() as u64,
            tokens: self.tokens as u64,
            capacity_tokens: self.capacity as u64,
            queries: self.queries,
            hits: self.hits,
            drafted: self.drafted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_the_continuation_of_a_recorded_stream() {
        let mut h = History::new(100);
        h.record(&[10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(h.draft(&[1, 11, 12, 13], 2), vec![14, 15]);
        assert_eq!(h.draft(&[7, 8, 9], 2), Vec::<u32>::new());
        let s = h.stats();
        assert_eq!(
            (s.streams, s.tokens, s.queries, s.hits, s.drafted),
            (1, 7, 2, 1, 2)
        );
    }

    #[test]
    fn longest_match_over_streams_and_bounded_by_ids() {
        let mut h = History::new(12);
        h.record(&[1, 2, 3, 4, 5, 6]); // [2,3,4] → 5
        h.record(&[9, 3, 4, 7, 7, 7]); // [3,4] → 7 only matches 2 ids: too short
        assert_eq!(h.draft(&[2, 3, 4], 1), vec![5]);
        // A third stream pushes out the oldest (12 ids kept at most).
        h.record(&[20, 21, 22, 23]);
        assert_eq!(h.stats().tokens, 10);
        assert_eq!(h.stats().streams, 2);
        assert_eq!(h.draft(&[2, 3, 4], 1), Vec::<u32>::new());
        // A stream longer than the bound keeps its newest ids.
        h.record(&(0..30).collect::<Vec<u32>>());
        assert_eq!(h.stats().tokens, 12);
        assert_eq!(h.draft(&[25, 26, 27], 2), vec![28, 29]);
        assert_eq!(
            h.draft(&[5, 6, 7], 2),
            Vec::<u32>::new(),
            "ids 0..18 were cut"
        );
        // Nothing kept at capacity 0.
        let mut none = History::new(0);
        none.record(&[1, 2, 3, 4, 5]);
        assert_eq!((none.stats().tokens, none.stats().streams), (0, 0));
        assert!(none.draft(&[1, 2, 3], 1).is_empty());
    }
}
