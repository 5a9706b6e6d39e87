//! Draft lookup for speculative decoding (SPEC.md §3.12): the continuation of the longest suffix
//! of a context found in a corpus of earlier token ids. Used by the worker over its own prompt
//! and output (n-gram drafting) and by the store over earlier jobs' token streams (history
//! drafting). A draft is only a guess: the worker verifies every drafted id against the model,
//! so nothing here can change an emitted token.

/// Shortest suffix worth matching: a two-id match proposes noise more often than not.
pub const MIN_MATCH: usize = 3;

/// Longest suffix tried (longer matches are rare and cost more to search).
pub const MAX_MATCH: usize = 8;

/// The (match length, continuation) of the longest suffix of `context` (between [`MIN_MATCH`]
/// and [`MAX_MATCH`] ids) that occurs in `corpus` followed by at least one id, taking the LATEST
/// such occurrence; the continuation holds at most `k` ids. An occurrence that ends at the very
/// end of `corpus` has no continuation and is skipped, so `corpus == context` works (n-gram
/// drafting over the job's own ids).
pub fn lookup<'c>(corpus: &'c [u32], context: &[u32], k: usize) -> Option<(usize, &'c [u32])> {
    if k == 0 {
        return None;
    }
    let longest = MAX_MATCH.min(context.len());
    for m in (MIN_MATCH..=longest).rev() {
        let suffix = &context[context.len() - m..];
        // Occurrence [s, s + m) followed by at least one id: s + m < corpus.len().
        let last_start = match corpus.len().checked_sub(m + 1) {
            Some(s) => s,
            None => continue,
        };
        for s in (0..=last_start).rev() {
            if &corpus[s..s + m] == suffix {
                let from = s + m;
                let to = (from + k).min(corpus.len());
                return Some((m, &corpus[from..to]));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_latest_match_wins() {
        //            0  1  2  3  4  5  6  7  8  9 10 11 12
        let corpus = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3];
        // Suffix [1,2,3] occurs at 0 (→ 9) and 4 (→ 4, 5): the latest wins.
        assert_eq!(lookup(&corpus, &[7, 1, 2, 3], 2), Some((3, &[4, 5][..])));
        // A longer match beats a later shorter one: [9,1,2,3] only at 3.
        assert_eq!(lookup(&corpus, &[9, 1, 2, 3], 3), Some((4, &[4, 5, 6][..])));
        // Continuation cut at the corpus end.
        assert_eq!(lookup(&corpus, &[5, 6, 7], 9), Some((3, &[2, 3][..])));
    }

    #[test]
    fn no_match_short_context_or_zero_k() {
        let corpus = [1, 2, 3, 4];
        assert_eq!(lookup(&corpus, &[8, 9, 10], 4), None);
        assert_eq!(lookup(&corpus, &[2, 3], 4), None, "shorter than MIN_MATCH");
        assert_eq!(lookup(&corpus, &[1, 2, 3], 0), None);
        // The context itself as corpus: its own trailing occurrence has no continuation.
        let ctx = [5, 6, 7, 8, 5, 6, 7];
        assert_eq!(lookup(&ctx, &ctx, 3), Some((3, &[8, 5, 6][..])));
        assert_eq!(lookup(&[5, 6, 7], &[5, 6, 7], 3), None);
    }
}
