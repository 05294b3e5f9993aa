//! The reference's coordinator: anchors publish codes per (group, token_start) with a count
//! of readers; each reuse layer reads them once; a segment is dropped once all have read.
//! `max_ctx` bounds the tokens published but not yet read by everyone. Unlike the reference,
//! a reader that falls back (the anchor had not published yet) is remembered, so the
//! segment the anchor publishes later is not kept for a reader that will never come.

use std::collections::HashMap;

use crate::error::{Result, XqError};

#[derive(Clone)]
struct Segment<T> {
    payload: T,
    tokens: usize,
    readers_left: usize,
}

/// Published segments of a set's anchors, keyed by (group, token_start).
#[derive(Clone)]
pub struct Coordinator<T> {
    max_ctx: usize,
    segments: HashMap<(usize, usize), Segment<T>>,
    fell_back: HashMap<(usize, usize), usize>,
}

impl<T: Clone> Coordinator<T> {
    /// An empty coordinator with a budget of `max_ctx` live tokens.
    pub fn new(max_ctx: usize) -> Self {
        Coordinator {
            max_ctx,
            segments: HashMap::new(),
            fell_back: HashMap::new(),
        }
    }

    /// Tokens published and not yet read by every reader.
    pub fn live_tokens(&self) -> usize {
        self.segments.values().map(|s| s.tokens).sum()
    }

    fn readers_left(&self, key: (usize, usize), readers: usize) -> usize {
        readers.saturating_sub(self.fell_back.get(&key).copied().unwrap_or(0))
    }

    /// Checks that publishing `tokens` for `(group, start)` with `readers` readers fits
    /// `max_ctx`, without changing anything.
    pub fn check_publish(
        &self,
        group: usize,
        start: usize,
        tokens: usize,
        readers: usize,
    ) -> Result<()> {
        if self.readers_left((group, start), readers) == 0 {
            return Ok(());
        }
        let live = self.live_tokens();
        if live + tokens > self.max_ctx {
            return Err(XqError::ContextBudget(format!(
                "group {group}: publishing {tokens} tokens on top of {live} unread would exceed max_ctx = {}",
                self.max_ctx
            )));
        }
        Ok(())
    }

    /// Publishes a segment for `readers` reuse layers (nothing is kept when there are none,
    /// or when they all fell back already).
    pub fn publish(
        &mut self,
        group: usize,
        start: usize,
        tokens: usize,
        readers: usize,
        payload: T,
    ) -> Result<()> {
        self.check_publish(group, start, tokens, readers)?;
        let key = (group, start);
        let left = self.readers_left(key, readers);
        self.fell_back.remove(&key);
        if left > 0 {
            self.segments.insert(
                key,
                Segment {
                    payload,
                    tokens,
                    readers_left: left,
                },
            );
        }
        Ok(())
    }

    /// One reader's read: the payload, or `None` when missing or consumed. The segment is
    /// dropped after its last reader.
    pub fn fetch(&mut self, group: usize, start: usize) -> Option<T> {
        let payload = self.peek(group, start)?;
        self.consume(group, start);
        Some(payload)
    }

    /// The payload of `(group, start)` without reading it.
    pub fn peek(&self, group: usize, start: usize) -> Option<T> {
        self.segments
            .get(&(group, start))
            .map(|s| s.payload.clone())
    }

    /// Counts one read of `(group, start)`; drops the segment after its last reader.
    pub fn consume(&mut self, group: usize, start: usize) {
        let key = (group, start);
        if let Some(seg) = self.segments.get_mut(&key) {
            seg.readers_left -= 1;
            if seg.readers_left == 0 {
                self.segments.remove(&key);
            }
        }
    }

    /// A reader quantized `(group, start)` itself: it will not read the anchor's segment.
    pub fn fell_back(&mut self, group: usize, start: usize) {
        *self.fell_back.entry((group, start)).or_insert(0) += 1;
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.segments.clear();
        self.fell_back.clear();
    }
}
