//! `builtin:sim`: the simulator's deterministic tokenizer and chat format.
//!
//! A piece of text ends after a whitespace or ASCII punctuation character, or
//! once it holds at least [`MAX_PIECE_BYTES`] bytes. Each rule looks only at
//! the text already in the piece, so a token boundary depends only on the text
//! to its left: two prompts that share a prefix share its tokens (all but a
//! piece cut short by the end of the shorter text). A piece's id is a hash of
//! its bytes, so ids need no vocabulary file.
//!
//! Generated text is drawn from [`GENERATION_WORDS`], each a complete piece
//! (a short word and a space, or a newline), so text the simulator produced
//! tokenizes back to the same ids when a client sends it in its next turn.

use xxhash_rust::xxh3::xxh3_64;

/// Vocabulary size the ids fall in, that of a common 8B model family.
pub const VOCAB_SIZE: u32 = 151_936;
/// Ids below this are reserved for special tokens.
pub const FIRST_PIECE_ID: u32 = 1_000;
/// A piece is cut once it holds at least this many bytes.
pub const MAX_PIECE_BYTES: usize = 8;

/// Words the simulator generates; each is a whole piece on its own.
pub const GENERATION_WORDS: [&str; 24] = [
    "alpha ", "beta ", "gamma ", "delta ", "river ", "stone ", "cloud ", "forest ", "ocean ", "lantern ", "garden ", "silver ", "copper ",
    "window ", "mountain", "the ", "a ", "of ", "and ", "to ", "is ", "in ", "that ", "\n",
];

/// The chat format: ChatML, `<|im_start|>{role}\n{content}<|im_end|>\n` per
/// message, then `<|im_start|>assistant\n` when a reply is to be generated.
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The id of one piece of text.
pub fn piece_id(piece: &str) -> u32 {
    FIRST_PIECE_ID + (xxh3_64(piece.as_bytes()) % u64::from(VOCAB_SIZE - FIRST_PIECE_ID)) as u32
}

/// Splits `text` into pieces; their concatenation is `text`.
pub fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut chars = text.char_indices();
    std::iter::from_fn(move || {
        for (i, c) in chars.by_ref() {
            let end = i + c.len_utf8();
            if c.is_whitespace() || c.is_ascii_punctuation() || end - start >= MAX_PIECE_BYTES {
                let piece = &text[start..end];
                start = end;
                return Some(piece);
            }
        }
        (start < text.len()).then(|| {
            let piece = &text[start..];
            start = text.len();
            piece
        })
    })
}

/// Whether the text ends exactly on a token boundary, so that appending more
/// text leaves every one of its tokens unchanged.
pub fn ends_on_boundary(text: &str) -> bool {
    pieces(text).last().is_none_or(|last| {
        last.chars().next_back().is_some_and(|c| c.is_whitespace() || c.is_ascii_punctuation()) || last.len() >= MAX_PIECE_BYTES
    })
}

/// Token ids of `text`.
pub fn encode(text: &str) -> Vec<u32> {
    pieces(text).map(piece_id).collect()
}

/// The text of a generated token, or `None` for an id that is not one of
/// [`GENERATION_WORDS`].
pub fn decode(id: u32) -> Option<&'static str> {
    GENERATION_WORDS.iter().copied().find(|w| piece_id(w) == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pieces_cut_after_space_and_punctuation_and_at_the_cap() {
        let p: Vec<&str> = pieces("Hello, world! extraordinarily").collect();
        assert_eq!(p, ["Hello,", " ", "world!", " ", "extraord", "inarily"]);
    }

    #[test]
    fn generation_words_are_whole_pieces_with_distinct_ids() {
        let mut ids: Vec<u32> = GENERATION_WORDS.iter().map(|w| piece_id(w)).collect();
        for w in GENERATION_WORDS {
            assert!(ends_on_boundary(w), "{w:?} must end on a boundary");
            assert_eq!(pieces(w).count(), 1, "{w:?} must be one piece");
            assert_eq!(decode(piece_id(w)), Some(w));
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GENERATION_WORDS.len());
    }

    #[test]
    fn ids_stay_in_the_vocabulary() {
        for p in ["", "a", "zzzzzzzz", "日本語", "\u{0}"] {
            let id = piece_id(p);
            assert!((FIRST_PIECE_ID..VOCAB_SIZE).contains(&id));
        }
    }

    proptest! {
        #[test]
        fn pieces_concatenate_to_the_text(text in "\\PC{0,64}") {
            prop_assert_eq!(pieces(&text).collect::<String>(), text);
        }

        #[test]
        fn shared_prefix_gives_shared_tokens(a in "\\PC{0,48}", b in "\\PC{0,48}") {
            let alone = encode(&a);
            let joined = encode(&format!("{a}{b}"));
            let stable = if ends_on_boundary(&a) { alone.len() } else { alone.len().saturating_sub(1) };
            prop_assert_eq!(&joined[..stable], &alone[..stable]);
        }

        #[test]
        fn generated_text_retokenizes_to_the_same_ids(idx in proptest::collection::vec(0..GENERATION_WORDS.len(), 0..40), prefix in "\\PC{0,20}\n") {
            let ids: Vec<u32> = idx.iter().map(|&i| piece_id(GENERATION_WORDS[i])).collect();
            let text: String = ids.iter().map(|&id| decode(id).unwrap_or_default()).collect();
            let before = encode(&prefix);
            let after = encode(&format!("{prefix}{text}<|im_end|>"));
            prop_assert_eq!(&after[..before.len()], &before[..]);
            prop_assert_eq!(&after[before.len()..before.len() + ids.len()], &ids[..]);
        }
    }
}
