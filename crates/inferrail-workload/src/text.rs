//! Seeded filler text whose `builtin:sim` token count is its word count: every
//! word is at most seven letters and followed by a space, so each is one piece.

use rand::Rng;
use rand::rngs::StdRng;

/// Words the filler is drawn from.
pub const WORDS: [&str; 64] = [
    "about", "above", "after", "again", "air", "all", "animal", "answer", "area", "back", "bank", "become", "begin", "best", "bird",
    "black", "blue", "boat", "body", "book", "bring", "build", "call", "carry", "cause", "center", "change", "city", "class", "close",
    "cold", "color", "common", "course", "cover", "cross", "dark", "deep", "direct", "door", "draw", "early", "earth", "east", "energy",
    "engine", "enough", "even", "event", "every", "field", "figure", "final", "fire", "first", "follow", "force", "form", "free", "friend",
    "front", "garden", "glass", "green",
];

/// `tokens` pieces of text: a marker that makes it unique, then random words.
/// The marker is one piece while it is at most seven bytes long.
pub fn unique(rng: &mut StdRng, marker: &str, tokens: usize) -> String {
    let mut out = String::with_capacity(tokens * 7);
    out.push_str(marker);
    for _ in 1..tokens {
        out.push(' ');
        out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    out
}

/// `tokens` pieces of text as the simulator generates it, for the assistant
/// turns of a synthetic conversation.
pub fn generated(rng: &mut StdRng, tokens: usize) -> String {
    let words = inferrail_tokenize::sim::GENERATION_WORDS;
    (0..tokens).map(|_| words[rng.random_range(0..words.len())]).collect()
}

/// An inclusive range of whole numbers, written `MIN-MAX` (or one number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    /// Smallest value drawn.
    pub min: u64,
    /// Largest value drawn.
    pub max: u64,
}

impl Span {
    /// A uniform draw from the range.
    pub fn draw(self, rng: &mut StdRng) -> u64 {
        rng.random_range(self.min..=self.max)
    }

    /// A uniform draw from the range as real numbers.
    pub fn draw_f64(self, rng: &mut StdRng) -> f64 {
        if self.min == self.max {
            return self.min as f64;
        }
        rng.random_range(self.min as f64..self.max as f64)
    }

    /// The middle of the range.
    pub fn mean(self) -> f64 {
        (self.min + self.max) as f64 / 2.0
    }
}

impl std::str::FromStr for Span {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once('-').unwrap_or((s, s));
        let parse = |x: &str| x.trim().parse::<u64>().map_err(|e| format!("{x:?} in {s:?}: {e}"));
        let span = Span { min: parse(a)?, max: parse(b)? };
        if span.min > span.max {
            return Err(format!("{s:?}: the minimum is above the maximum"));
        }
        Ok(span)
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.min, self.max)
    }
}
