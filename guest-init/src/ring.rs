//! A program's kept output: the last bytes it wrote to stdout and stderr,
//! in the order written, addressed by their offset in everything it wrote.
//!
//! Readers keep their own offset: one that falls behind the oldest kept
//! byte learns how many it missed (never silently skipped). Every chunk
//! costs [`CHUNK_COST`] besides its bytes, so a program that writes one
//! byte at a time, alternating streams, is held to the same memory as one
//! that writes large blocks.

use std::collections::VecDeque;

use husk_protocol::Stream;

/// What a chunk costs besides its bytes (its header and allocation).
pub const CHUNK_COST: usize = 64;
/// Writes of one stream are joined into chunks of up to this size.
const JOIN: usize = 32 << 10;
/// The smallest ring: room for a chunk's cost and some bytes.
pub const MIN_CAPACITY: usize = 4 << 10;

#[derive(Debug)]
struct Chunk {
    /// Offset of `data[0]`.
    at: u64,
    stream: Stream,
    data: Vec<u8>,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.at + self.data.len() as u64
    }
}

#[derive(Debug)]
pub struct Ring {
    chunks: VecDeque<Chunk>,
    /// Offset of the oldest byte kept.
    start: u64,
    /// Offset after the newest byte: everything written so far.
    end: u64,
    /// Bytes kept plus [`CHUNK_COST`] per chunk; at most `capacity`.
    cost: usize,
    capacity: usize,
}

impl Ring {
    pub fn new(capacity: usize) -> Ring {
        Ring {
            chunks: VecDeque::new(),
            start: 0,
            end: 0,
            cost: 0,
            capacity: capacity.max(MIN_CAPACITY),
        }
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// What keeping everything from `at` on, plus `more` bytes in a chunk
    /// of their own, would cost.
    pub fn cost_from(&self, at: u64, more: usize) -> usize {
        let first = self.index(at);
        let chunks = self.chunks.len() - first;
        let bytes = self.end.saturating_sub(at.max(self.start)) as usize;
        bytes + chunks * CHUNK_COST + more + CHUNK_COST
    }

    /// Appends `data`; the oldest bytes go to keep within the capacity.
    pub fn push(&mut self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        match self.chunks.back_mut() {
            Some(last) if last.stream == stream && last.data.len() + data.len() <= JOIN => {
                last.data.extend_from_slice(data);
            }
            _ => {
                self.chunks.push_back(Chunk {
                    at: self.end,
                    stream,
                    data: data.to_vec(),
                });
                self.cost += CHUNK_COST;
            }
        }
        self.cost += data.len();
        self.end += data.len() as u64;
        while self.cost > self.capacity {
            let excess = self.cost - self.capacity;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.data.len() <= excess {
                let gone = front.data.len();
                self.chunks.pop_front();
                self.cost -= gone + CHUNK_COST;
                self.start += gone as u64;
            } else {
                front.data.drain(..excess);
                front.at += excess as u64;
                self.cost -= excess;
                self.start += excess as u64;
            }
        }
        if self.chunks.is_empty() {
            self.start = self.end;
        }
    }

    /// Up to `max` bytes from offset `at` (not before [`Ring::start`]),
    /// all of one stream; none at the end.
    pub fn read(&self, at: u64, max: usize) -> Option<(Stream, Vec<u8>)> {
        let chunk = self.chunks.get(self.index(at))?;
        let from = at.saturating_sub(chunk.at) as usize;
        let to = chunk.data.len().min(from + max);
        (from < to).then(|| (chunk.stream, chunk.data[from..to].to_vec()))
    }

    /// The index of the chunk holding offset `at` (or the next one).
    fn index(&self, at: u64) -> usize {
        self.chunks.partition_point(|c| c.end() <= at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(ring: &Ring, mut at: u64) -> Vec<(Stream, Vec<u8>)> {
        let mut out: Vec<(Stream, Vec<u8>)> = Vec::new();
        while let Some((s, d)) = ring.read(at, 7) {
            at += d.len() as u64;
            match out.last_mut() {
                Some((last, data)) if *last == s => data.extend(d),
                _ => out.push((s, d)),
            }
        }
        out
    }

    #[test]
    fn bytes_are_read_back_from_any_offset_kept() {
        let mut ring = Ring::new(1 << 20);
        ring.push(Stream::Stdout, b"one ");
        ring.push(Stream::Stdout, b"two ");
        ring.push(Stream::Stderr, b"oops ");
        ring.push(Stream::Stdout, b"three");
        assert_eq!((ring.start(), ring.end()), (0, 18));
        assert_eq!(
            all(&ring, 0),
            vec![
                (Stream::Stdout, b"one two ".to_vec()),
                (Stream::Stderr, b"oops ".to_vec()),
                (Stream::Stdout, b"three".to_vec()),
            ]
        );
        assert_eq!(
            all(&ring, 10),
            vec![
                (Stream::Stderr, b"ps ".to_vec()),
                (Stream::Stdout, b"three".to_vec()),
            ]
        );
        assert_eq!(ring.read(18, 10), None);
    }

    #[test]
    fn the_oldest_bytes_go_first_and_the_cost_stays_bounded() {
        let mut ring = Ring::new(MIN_CAPACITY);
        let mut written = 0u64;
        for i in 0..10_000u32 {
            // One byte at a time, alternating streams: a chunk each.
            let stream = if i % 2 == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            ring.push(stream, &[b'a' + (i % 26) as u8]);
            written += 1;
            assert!(ring.cost <= ring.capacity, "{}", ring.cost);
        }
        assert_eq!(ring.end(), written);
        let kept = ring.end() - ring.start();
        assert!(
            kept > 0 && kept < (MIN_CAPACITY / CHUNK_COST) as u64,
            "{kept}"
        );
        // What is kept is the newest, in order.
        let last = all(&ring, ring.start());
        let bytes: Vec<u8> = last.iter().flat_map(|(_, d)| d.clone()).collect();
        let want: Vec<u8> = (written - kept..written)
            .map(|i| b'a' + (i % 26) as u8)
            .collect();
        assert_eq!(bytes, want);
    }

    #[test]
    fn a_chunk_larger_than_the_ring_keeps_its_end() {
        let mut ring = Ring::new(MIN_CAPACITY);
        let big: Vec<u8> = (0..3 * MIN_CAPACITY).map(|i| i as u8).collect();
        ring.push(Stream::Stdout, &big);
        assert_eq!(ring.end(), big.len() as u64);
        assert_eq!(ring.cost, MIN_CAPACITY);
        let kept = (ring.end() - ring.start()) as usize;
        assert_eq!(kept, MIN_CAPACITY - CHUNK_COST);
        let got: Vec<u8> = all(&ring, ring.start())
            .into_iter()
            .flat_map(|(_, d)| d)
            .collect();
        assert_eq!(got, big[big.len() - kept..]);
    }

    #[test]
    fn the_cost_from_an_offset_counts_its_chunks() {
        let mut ring = Ring::new(1 << 20);
        ring.push(Stream::Stdout, b"abc");
        ring.push(Stream::Stderr, b"de");
        assert_eq!(ring.cost_from(0, 0), 5 + 2 * CHUNK_COST + CHUNK_COST);
        assert_eq!(ring.cost_from(4, 10), 1 + CHUNK_COST + 10 + CHUNK_COST);
        assert_eq!(ring.cost_from(5, 1), 1 + CHUNK_COST);
    }
}
