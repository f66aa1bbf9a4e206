//! A fast encoder for the byte-level BPE tokenizers of the Qwen 2/3 and
//! Llama 3 families, giving the ids the Hugging Face pipeline gives.
//!
//! The Hugging Face pipeline spends most of an encode in bookkeeping this
//! router does not need (offsets, alignments) and in the regex that splits
//! text into words. Here the split is a hand-written scan that follows the
//! regex's alternatives in order, with the regex engine's own Unicode classes;
//! a word is merged from its bytes by a plain loop over the model's merge
//! ranks, and its ids are kept in a concurrent cache, so it is merged once.
//! Tokenizers of any other shape keep the Hugging Face pipeline; the property
//! tests compare the two on adversarial text.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::{Value, json};
use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

/// The split pattern of Qwen 2 and 3: one digit a word.
const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The split pattern of Llama 3: up to three digits a word.
const LLAMA3_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Words kept before the cache starts over.
const WORD_CACHE: usize = 1 << 17;
/// Longer words (runs of symbols, blobs) are merged each time rather than kept.
const MAX_CACHED_WORD: usize = 64;

/// Encodes text the way a byte-level BPE tokenizer with the Qwen or Llama 3 split does.
pub(super) struct ByteLevel {
    /// Most digits one word holds.
    digits: usize,
    /// Whether text is NFC-normalized before it is split.
    nfc: bool,
    /// Every added token, matched on the raw text, and its id by pattern index.
    added: Option<(AhoCorasick, Vec<u32>)>,
    /// The id of each byte alone.
    byte_ids: [u32; 256],
    /// Each merge by the pair of ids it joins: its rank (lower merges first) and the id it makes.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`, whole words found in the vocabulary (by their bytes) are one token.
    whole_words: Option<HashMap<Box<[u8]>, u32>>,
    /// Ids of words already encoded.
    words: papaya::HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
}

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

impl ByteLevel {
    /// The fast encoder for `tok`, or `None` when its pipeline is not one this module reproduces.
    pub(super) fn new(json: &Value, tok: &tokenizers::Tokenizer) -> Option<Self> {
        let nfc = match &json["normalizer"] {
            Value::Null => false,
            n if *n == json!({"type": "NFC"}) => true,
            _ => return None,
        };
        let [split, byte_level] = json["pre_tokenizer"]["pretokenizers"].as_array()?.as_slice() else { return None };
        let digits = match split["pattern"]["Regex"].as_str()? {
            QWEN_SPLIT => 1,
            LLAMA3_SPLIT => 3,
            _ => return None,
        };
        let plain = |v: &Value| v.is_null() || v == "";
        let model = &json["model"];
        let shape_ok = json["pre_tokenizer"]["type"] == "Sequence"
            && split["type"] == "Split"
            && split["behavior"] == "Isolated"
            && split["invert"] == false
            && byte_level["type"] == "ByteLevel"
            && byte_level["add_prefix_space"] == false
            && byte_level["use_regex"] == false
            && model["type"] == "BPE"
            && model["dropout"].is_null()
            && model["byte_fallback"] != true
            && plain(&model["continuing_subword_prefix"])
            && plain(&model["end_of_word_suffix"]);
        // Added tokens that strip whitespace, match whole words only or match normalized text are left to the full pipeline.
        let tokens = tok.get_added_tokens_decoder();
        if !shape_ok || tokens.values().any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()) {
            return None;
        }
        let (byte_ids, merges, whole_words) = vocabulary(model)?;
        let (ids, patterns): (Vec<u32>, Vec<String>) = tokens.into_iter().map(|(id, t)| (id, t.content)).unzip();
        let added = if patterns.is_empty() {
            None
        } else {
            Some((AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(&patterns).ok()?, ids))
        };
        let words =
            papaya::HashMap::builder().hasher(Default::default()).capacity(WORD_CACHE).resize_mode(papaya::ResizeMode::Blocking).build();
        Some(ByteLevel { digits, nfc, added, byte_ids, merges, whole_words, words })
    }

    /// Appends the ids of `text`, encoded without added special tokens.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let words = self.words.pin();
        let encode_words = |segment: &str, out: &mut Vec<u32>| {
            let normalized;
            let segment = if self.nfc && !segment.is_ascii() && is_nfc_quick(segment.chars()) != IsNormalized::Yes {
                normalized = segment.nfc().map(|(c, _)| c).collect::<String>();
                normalized.as_str()
            } else {
                segment
            };
            let mut at = 0;
            while at < segment.len() {
                let end = word_end(segment, at, self.digits);
                let word = &segment[at..end];
                if let Some(ids) = words.get(word) {
                    out.extend_from_slice(ids);
                } else {
                    let ids = self.merge(word.as_bytes());
                    out.extend_from_slice(&ids);
                    if word.len() <= MAX_CACHED_WORD {
                        if words.len() >= WORD_CACHE {
                            words.clear();
                        }
                        words.insert(word.into(), ids);
                    }
                }
                at = end;
            }
        };
        let mut start = 0;
        if let Some((finder, ids)) = &self.added {
            for m in finder.find_iter(text) {
                encode_words(&text[start..m.start()], out);
                out.push(ids[m.pattern().as_usize()]);
                start = m.end();
            }
        }
        encode_words(&text[start..], out);
    }

    /// The ids of one word: its bytes, merged pair by pair, the lowest-ranked
    /// pair first and the leftmost of equals first, as the BPE model merges.
    /// Candidate merges wait in a heap, so a long word costs n log n, not n².
    fn merge(&self, word: &[u8]) -> Box<[u32]> {
        if let Some(&id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            return Box::new([id]);
        }
        // The symbols as a linked list over the word's bytes (index, not pointer); a merged-away symbol's id is GONE.
        const GONE: u32 = u32::MAX;
        let mut syms: Vec<Sym> =
            (0..word.len()).map(|i| Sym { id: self.byte_ids[usize::from(word[i])], prev: i.wrapping_sub(1), next: i + 1 }).collect();
        let id_at = |syms: &[Sym], i: usize| syms.get(i).map(|s| s.id).filter(|&id| id != GONE);
        let pair = |syms: &[Sym], left: usize| self.merges.get(&(id_at(syms, left)?, id_at(syms, syms[left].next)?)).copied();
        let mut heap = BinaryHeap::with_capacity(word.len());
        for left in 0..word.len().saturating_sub(1) {
            if let Some((rank, joined)) = pair(&syms, left) {
                heap.push(Reverse((rank, left, joined)));
            }
        }
        while let Some(Reverse((rank, left, joined))) = heap.pop() {
            // A candidate is stale when either symbol has changed since it was pushed.
            if id_at(&syms, left).is_none() || pair(&syms, left) != Some((rank, joined)) {
                continue;
            }
            let right = syms[left].next;
            let after = syms[right].next;
            syms[left].id = joined;
            syms[right].id = GONE;
            syms[left].next = after;
            if let Some(after) = syms.get_mut(after) {
                after.prev = left;
            }
            for l in [syms[left].prev, left] {
                if l < syms.len()
                    && let Some((rank, joined)) = pair(&syms, l)
                {
                    heap.push(Reverse((rank, l, joined)));
                }
            }
        }
        syms.iter().map(|s| s.id).filter(|&id| id != GONE).collect()
    }
}

/// One symbol of a word being merged.
struct Sym {
    id: u32,
    prev: usize,
    next: usize,
}

/// The byte ids, merges and (with `ignore_merges`) whole words of a byte-level BPE model in `tokenizer.json`.
#[allow(clippy::type_complexity)]
fn vocabulary(model: &Value) -> Option<([u32; 256], HashMap<(u32, u32), (u32, u32)>, Option<HashMap<Box<[u8]>, u32>>)> {
    let vocab = model["vocab"].as_object()?;
    let id = |token: &str| vocab.get(token)?.as_u64().and_then(|id| u32::try_from(id).ok());
    let chars = byte_chars();
    let mut byte_ids = [0; 256];
    for (b, c) in byte_ids.iter_mut().zip(chars) {
        *b = id(c.encode_utf8(&mut [0; 4]))?;
    }
    let mut merges = HashMap::default();
    for (rank, merge) in model["merges"].as_array()?.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(pair) => pair.split_once(' ')?,
            Value::Array(pair) => (pair.first()?.as_str()?, pair.get(1)?.as_str()?),
            _ => return None,
        };
        let joined = id(&format!("{a}{b}"))?;
        // A pair listed twice keeps its last rank, as the Hugging Face model builds its map.
        merges.insert((id(a)?, id(b)?), (u32::try_from(rank).ok()?, joined));
    }
    let whole_words = if model["ignore_merges"] == true {
        let byte_of: HashMap<char, u8> = chars.iter().zip(0..=255u8).map(|(&c, b)| (c, b)).collect();
        let words = vocab.iter().filter_map(|(token, id)| {
            let bytes: Option<Box<[u8]>> = token.chars().map(|c| byte_of.get(&c).copied()).collect();
            Some((bytes?, u32::try_from(id.as_u64()?).ok()?))
        });
        Some(words.collect())
    } else {
        None
    };
    Some((byte_ids, merges, whole_words))
}

/// GPT-2's reversible map from bytes to printable characters, which byte-level vocabularies are written in.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (b, c) in chars.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *c = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// What the split patterns tell characters apart by.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    /// `\p{L}`.
    Letter,
    /// `\p{N}`.
    Number,
    /// `\s`.
    Space,
    /// Anything else.
    Other,
}

/// Non-ASCII ranges of each class, sorted, from the regex engine's own Unicode tables.
static RANGES: LazyLock<Vec<(char, char, Class)>> = LazyLock::new(|| {
    let mut ranges = Vec::new();
    for (pattern, class) in [(r"\p{L}", Class::Letter), (r"\p{N}", Class::Number), (r"\s", Class::Space)] {
        let Ok(hir) = regex_syntax::parse(pattern) else { continue };
        if let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) = hir.kind() {
            ranges.extend(set.ranges().iter().map(|r| (r.start(), r.end(), class)));
        }
    }
    ranges.sort_by_key(|r| r.0);
    ranges
});

fn class(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r' => Class::Space,
            _ => Class::Other,
        };
    }
    let i = RANGES.partition_point(|r| r.0 <= c);
    match i.checked_sub(1).map(|i| RANGES[i]) {
        Some((_, end, class)) if c <= end => class,
        _ => Class::Other,
    }
}

/// The character at byte `at` of `s` and the byte after it.
fn char_at(s: &str, at: usize) -> Option<(char, usize)> {
    let b = *s.as_bytes().get(at)?;
    if b.is_ascii() {
        return Some((char::from(b), at + 1));
    }
    let c = s[at..].chars().next()?;
    Some((c, at + c.len_utf8()))
}

/// The end of the run from `at` of characters that `keep` accepts, at most `max` of them.
fn run_end(s: &str, mut at: usize, max: usize, keep: impl Fn(char) -> bool) -> usize {
    let mut n = 0;
    while n < max
        && let Some((c, next)) = char_at(s, at)
        && keep(c)
    {
        at = next;
        n += 1;
    }
    at
}

/// The end of the word that starts at byte `at`: the first of the split
/// pattern's alternatives that matches there, as a backtracking regex
/// engine picks it.
fn word_end(s: &str, at: usize, digits: usize) -> usize {
    let Some((c, after)) = char_at(s, at) else { return at };
    let next = char_at(s, after);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == '\'' {
        let fold = |c: char| if c == 'ſ' { 's' } else { c.to_ascii_lowercase() };
        match next.map(|(c2, end)| (fold(c2), end)) {
            Some(('s' | 't' | 'm' | 'd', end)) => return end,
            Some((second @ ('r' | 'v' | 'l'), end)) => {
                let third = if second == 'l' { 'l' } else { 'e' };
                if let Some((c3, end)) = char_at(s, end)
                    && fold(c3) == third
                {
                    return end;
                }
            }
            _ => {}
        }
    }
    let letters = |from| run_end(s, from, usize::MAX, |c| class(c) == Class::Letter);
    let class_c = class(c);
    match class_c {
        // [^\r\n\p{L}\p{N}]?\p{L}+ with nothing before the letters
        Class::Letter => return letters(after),
        // \p{N}{1,digits}
        Class::Number => return run_end(s, at, digits, |c| class(c) == Class::Number),
        _ => {}
    }
    let next_class = next.map(|(c2, _)| class(c2));
    // [^\r\n\p{L}\p{N}]?\p{L}+ with one character before the letters
    if c != '\r' && c != '\n' && next_class == Some(Class::Letter) {
        return letters(after);
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let others = |from| {
        let end = run_end(s, from, usize::MAX, |c| class(c) == Class::Other);
        run_end(s, end, usize::MAX, |c| c == '\r' || c == '\n')
    };
    if c == ' ' && next_class == Some(Class::Other) {
        return others(after);
    }
    if class_c == Class::Other {
        return others(after);
    }
    // Whitespace: \s*[\r\n]+ up to the run's last line break, else \s+(?!\S), else \s+.
    let mut end = at;
    let mut last_start = at;
    let mut after_break = None;
    while let Some((c, next)) = char_at(s, end)
        && class(c) == Class::Space
    {
        if c == '\r' || c == '\n' {
            after_break = Some(next);
        }
        last_start = end;
        end = next;
    }
    match after_break {
        Some(e) => e,
        None if end == s.len() || last_start == at => end,
        None => last_start,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split regex, run the way the Hugging Face pipeline runs it.
    fn regex_words(pattern: &str, s: &str) -> Vec<String> {
        static COMPILED: LazyLock<[fancy_regex::Regex; 2]> =
            LazyLock::new(|| [QWEN_SPLIT, LLAMA3_SPLIT].map(|p| fancy_regex::Regex::new(p).unwrap()));
        let re = &COMPILED[usize::from(pattern == LLAMA3_SPLIT)];
        re.find_iter(s).map(|m| m.unwrap().as_str().to_owned()).collect()
    }

    fn scan_words(s: &str, digits: usize) -> Vec<String> {
        let mut words = Vec::new();
        let mut at = 0;
        while at < s.len() {
            let end = word_end(s, at, digits);
            assert!(end > at, "no progress at {at} in {s:?}");
            words.push(s[at..end].to_owned());
            at = end;
        }
        words
    }

    #[test]
    fn the_qwen_and_llama3_families_take_the_fast_path_and_others_do_not() {
        for (family, fast) in [("qwen3", true), ("llama3_1", true), ("gemma3", false), ("deepseek_v3", false)] {
            let tok = crate::Tokenizer::load(crate::tokenizer::tests::family_dir(family).to_str().unwrap(), 0).unwrap();
            let crate::tokenizer::Encoder::Hf { fast: found, .. } = &tok.encoder else { panic!() };
            assert_eq!(found.is_some(), fast, "{family}");
        }
    }

    #[test]
    fn the_contractions_fold_case_as_the_regex_does() {
        // The regex's case-insensitive letters: only `s` has a non-ASCII fold (ſ).
        for letter in ['s', 't', 'r', 'e', 'v', 'm', 'l', 'd'] {
            let hir = regex_syntax::parse(&format!("(?i){letter}")).unwrap();
            let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) = hir.kind() else { panic!() };
            let folded: Vec<char> = set.ranges().iter().flat_map(|r| r.start()..=r.end()).filter(|c| !c.is_ascii()).collect();
            assert_eq!(folded, if letter == 's' { vec!['ſ'] } else { vec![] }, "{letter}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        #[test]
        fn the_scan_splits_as_the_regex_does(s in "[ \t\r\n\u{a0}\u{3000}\u{2028}'sStTrReEvVmMlLdDſK a-c0-9٣²Ⅻ.,!?\u{301}é数据😀-]{0,24}") {
            proptest::prop_assert_eq!(scan_words(&s, 1), regex_words(QWEN_SPLIT, &s));
            proptest::prop_assert_eq!(scan_words(&s, 3), regex_words(LLAMA3_SPLIT, &s));
        }

        #[test]
        fn any_text_splits_as_the_regex_does(s in "\\PC{0,16}|\\p{Any}{0,16}") {
            proptest::prop_assert_eq!(scan_words(&s, 1), regex_words(QWEN_SPLIT, &s));
            proptest::prop_assert_eq!(scan_words(&s, 3), regex_words(LLAMA3_SPLIT, &s));
        }
    }
}
