//! Splits text into words as the regex pre-tokenizers of the Qwen 2/3,
//! Llama 3 and DeepSeek V3 tokenizers do, without running a regex, and
//! Gemma's text at the word boundaries no token spans.
//!
//! Each scan takes the pattern's alternatives in order at each position, as
//! a backtracking regex engine does (the first alternative that matches
//! wins, not the longest), and classifies characters with the regex engine's
//! own Unicode tables, so a character's class cannot drift from the regex's.
//! The tests run every scan against the regex on adversarial text.

use std::sync::LazyLock;

use serde_json::Value;

/// The split pattern of Qwen 2 and 3: one digit a word.
const QWEN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The split pattern of Llama 3: up to three digits a word.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek V3's three splits, applied one after another to every piece.
const DEEPSEEK: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// Which split a tokenizer uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Split {
    /// The Qwen and Llama 3 pattern, with the most digits one word holds.
    Gpt { digits: usize },
    /// DeepSeek V3's numbers, then CJK runs, then its word pattern.
    DeepSeek,
    /// Gemma's text after spaces became `▁`: its tokenizer splits nothing,
    /// but no token spans a `▁` run's start unless some token has the
    /// character before it right before a `▁` (`glued`), so a word may start
    /// at every other run of `▁` and merge as the whole text would.
    Metaspace { glued: Vec<char> },
}

impl Split {
    /// The split that `pretokenizers` (a Sequence's list, before its ByteLevel step) performs, if it is one of ours.
    pub(super) fn of(pretokenizers: &[Value]) -> Option<Self> {
        let patterns: Vec<&str> = pretokenizers
            .iter()
            .map(|p| {
                let isolated = p["type"] == "Split" && p["behavior"] == "Isolated" && p["invert"] == false;
                isolated.then(|| p["pattern"]["Regex"].as_str()).flatten()
            })
            .collect::<Option<_>>()?;
        match patterns.as_slice() {
            [QWEN] => Some(Split::Gpt { digits: 1 }),
            [LLAMA3] => Some(Split::Gpt { digits: 3 }),
            p if *p == DEEPSEEK => Some(Split::DeepSeek),
            _ => None,
        }
    }

    /// Calls `word` with each word of `text`, in order; the words concatenate to `text`.
    pub(super) fn words<'t>(&self, text: &'t str, mut word: impl FnMut(&'t str)) {
        match self {
            &Split::Gpt { digits } => {
                let mut at = 0;
                while at < text.len() {
                    let end = gpt_word_end(text, at, digits);
                    word(&text[at..end]);
                    at = end;
                }
            }
            Split::DeepSeek => {
                isolate(text, numbers, &mut |piece| isolate(piece, cjk, &mut |piece| isolate(piece, deepseek_word, &mut word)))
            }
            Split::Metaspace { glued } => {
                let mut start = 0;
                let mut before: Option<char> = None;
                for (at, c) in text.char_indices() {
                    if c == '\u{2581}' && before.is_some_and(|b| b != '\u{2581}' && !glued.contains(&b)) {
                        word(&text[start..at]);
                        start = at;
                    }
                    before = Some(c);
                }
                if start < text.len() {
                    word(&text[start..]);
                }
            }
        }
    }
}

/// What the split patterns tell characters apart by: `\p{L}`, `\p{N}`, `\p{M}`, `\p{P}`, `\p{S}`, `\s`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Number,
    Mark,
    Punct,
    Symbol,
    Space,
    Other,
}

/// The classes' ranges, sorted, from the regex engine's own Unicode tables, and the ASCII characters' classes.
/// Ranges of characters of one class: first, last, class.
type Ranges = Vec<(char, char, Class)>;

static CLASSES: LazyLock<(Ranges, [Class; 128])> = LazyLock::new(|| {
    let mut ranges = Vec::new();
    let classes = [
        (r"\p{L}", Class::Letter),
        (r"\p{N}", Class::Number),
        (r"\p{M}", Class::Mark),
        (r"\p{P}", Class::Punct),
        (r"\p{S}", Class::Symbol),
    ];
    for (pattern, class) in classes.into_iter().chain([(r"\s", Class::Space)]) {
        let Ok(hir) = regex_syntax::parse(pattern) else { continue };
        if let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) = hir.kind() {
            ranges.extend(set.ranges().iter().map(|r| (r.start(), r.end(), class)));
        }
    }
    ranges.sort_by_key(|r| r.0);
    let mut ascii = [Class::Other; 128];
    for (b, class) in ascii.iter_mut().enumerate() {
        *class = search(&ranges, char::from(b as u8));
    }
    (ranges, ascii)
});

fn search(ranges: &[(char, char, Class)], c: char) -> Class {
    match ranges.partition_point(|r| r.0 <= c).checked_sub(1).map(|i| ranges[i]) {
        Some((_, end, class)) if c <= end => class,
        _ => Class::Other,
    }
}

fn class(c: char) -> Class {
    let (ranges, ascii) = &*CLASSES;
    match ascii.get(c as usize) {
        Some(&class) => class,
        None => search(ranges, c),
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

fn is(c: char, classes: &[Class]) -> bool {
    classes.contains(&class(c))
}

/// The end of the word that starts at byte `at` under the Qwen / Llama 3 pattern.
fn gpt_word_end(s: &str, at: usize, digits: usize) -> usize {
    use Class::{Letter, Number, Space};
    let Some((c, after)) = char_at(s, at) else { return at };
    let next = char_at(s, after).map(|(c, _)| c);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d): only `s` folds to a non-ASCII letter (ſ), as the test below checks.
    if c == '\'' {
        let fold = |c: char| if c == 'ſ' { 's' } else { c.to_ascii_lowercase() };
        match char_at(s, after).map(|(c2, end)| (fold(c2), end)) {
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
    let letters = |from| run_end(s, from, usize::MAX, |c| is(c, &[Letter]));
    let other = |c: char| !is(c, &[Letter, Number, Space]);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if is(c, &[Letter]) {
        return letters(after);
    }
    // \p{N}{1,digits}
    if is(c, &[Number]) {
        return run_end(s, at, digits, |c| is(c, &[Number]));
    }
    if c != '\r' && c != '\n' && next.is_some_and(|n| is(n, &[Letter])) {
        return letters(after);
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let others = |from| crlf_end(s, run_end(s, from, usize::MAX, other));
    if c == ' ' && next.is_some_and(other) {
        return others(after);
    }
    if other(c) {
        return others(after);
    }
    space_end(s, at)
}

fn crlf_end(s: &str, at: usize) -> usize {
    run_end(s, at, usize::MAX, |c| c == '\r' || c == '\n')
}

/// The end of the whitespace word at `at`: `\s*[\r\n]+` up to the run's last
/// line break, else `\s+(?!\S)` (all but the last space when a word follows),
/// else `\s+`.
fn space_end(s: &str, at: usize) -> usize {
    let mut end = at;
    let mut last_start = at;
    let mut after_break = None;
    while let Some((c, next)) = char_at(s, end)
        && is(c, &[Class::Space])
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

/// Splits `text` as an `Isolated` split does: each match of `matched` (the
/// end of a match starting at a byte, if one does) is a piece, and so is each
/// stretch between matches.
fn isolate<'t>(text: &'t str, matched: fn(&str, usize) -> Option<usize>, piece: &mut impl FnMut(&'t str)) {
    let (mut gap, mut at) = (0, 0);
    while let Some((_, next)) = char_at(text, at) {
        match matched(text, at).filter(|&end| end > at) {
            Some(end) => {
                if gap < at {
                    piece(&text[gap..at]);
                }
                piece(&text[at..end]);
                (gap, at) = (end, end);
            }
            None => at = next,
        }
    }
    if gap < text.len() {
        piece(&text[gap..]);
    }
}

/// `\p{N}{1,3}`.
fn numbers(s: &str, at: usize) -> Option<usize> {
    Some(run_end(s, at, 3, |c| is(c, &[Class::Number])))
}

/// `[一-龥぀-ゟ゠-ヿ]+`.
fn cjk(s: &str, at: usize) -> Option<usize> {
    Some(run_end(s, at, usize::MAX, |c| matches!(c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}')))
}

/// DeepSeek V3's word pattern at `at`; `None` where no alternative matches (the character joins a gap).
fn deepseek_word(s: &str, at: usize) -> Option<usize> {
    use Class::{Letter, Mark, Punct, Symbol};
    let (c, after) = char_at(s, at)?;
    let next = char_at(s, after).map(|(c, _)| c);
    // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
    if c.is_ascii_punctuation() {
        let end = run_end(s, after, usize::MAX, |c| c.is_ascii_alphabetic());
        if end > after {
            return Some(end);
        }
    }
    // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
    let letters = |from| run_end(s, from, usize::MAX, |c| is(c, &[Letter, Mark]));
    if c != '\r' && c != '\n' && !is(c, &[Letter, Punct, Symbol]) && next.is_some_and(|n| is(n, &[Letter, Mark])) {
        return Some(letters(after));
    }
    if is(c, &[Letter, Mark]) {
        return Some(letters(after));
    }
    // ' ?[\p{P}\p{S}]+[\r\n]*'
    let marks = |from| crlf_end(s, run_end(s, from, usize::MAX, |c| is(c, &[Punct, Symbol])));
    if c == ' ' && next.is_some_and(|n| is(n, &[Punct, Symbol])) {
        return Some(marks(after));
    }
    if is(c, &[Punct, Symbol]) {
        return Some(marks(after));
    }
    is(c, &[Class::Space]).then(|| space_end(s, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words the Hugging Face pipeline makes: each regex in turn splits every piece, matches and gaps alike.
    fn regex_words(patterns: &[&str], s: &str) -> Vec<String> {
        static COMPILED: LazyLock<std::collections::HashMap<&str, fancy_regex::Regex>> =
            LazyLock::new(|| [QWEN, LLAMA3].iter().chain(&DEEPSEEK).map(|&p| (p, fancy_regex::Regex::new(p).unwrap())).collect());
        let mut pieces = vec![s.to_owned()];
        for pattern in patterns {
            let re = &COMPILED[pattern];
            let mut next = Vec::new();
            for piece in &pieces {
                let mut gap = 0;
                for m in re.find_iter(piece) {
                    let m = m.unwrap();
                    if gap < m.start() {
                        next.push(piece[gap..m.start()].to_owned());
                    }
                    if !m.as_str().is_empty() {
                        next.push(m.as_str().to_owned());
                    }
                    gap = m.end();
                }
                if gap < piece.len() {
                    next.push(piece[gap..].to_owned());
                }
            }
            pieces = next;
        }
        pieces
    }

    fn scan_words(split: Split, s: &str) -> Vec<String> {
        let mut words = Vec::new();
        split.words(s, |w| words.push(w.to_owned()));
        words
    }

    #[test]
    fn the_patterns_are_the_tokenizer_files() {
        for (family, split) in
            [("qwen3", Split::Gpt { digits: 1 }), ("llama3_1", Split::Gpt { digits: 3 }), ("deepseek_v3", Split::DeepSeek)]
        {
            let path = crate::tokenizer::tests::family_dir(family).join("tokenizer.json");
            let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            let steps = json["pre_tokenizer"]["pretokenizers"].as_array().unwrap();
            assert_eq!(Split::of(&steps[..steps.len() - 1]), Some(split), "{family}");
        }
    }

    #[test]
    fn the_contractions_fold_case_as_the_regex_does() {
        for letter in ['s', 't', 'r', 'e', 'v', 'm', 'l', 'd'] {
            let hir = regex_syntax::parse(&format!("(?i){letter}")).unwrap();
            let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) = hir.kind() else { panic!() };
            let folded: Vec<char> = set.ranges().iter().flat_map(|r| r.start()..=r.end()).filter(|c| !c.is_ascii()).collect();
            assert_eq!(folded, if letter == 's' { vec!['ſ'] } else { vec![] }, "{letter}");
        }
    }

    fn check(s: &str) -> Result<(), proptest::test_runner::TestCaseError> {
        proptest::prop_assert_eq!(scan_words(Split::Gpt { digits: 1 }, s), regex_words(&[QWEN], s));
        proptest::prop_assert_eq!(scan_words(Split::Gpt { digits: 3 }, s), regex_words(&[LLAMA3], s));
        proptest::prop_assert_eq!(scan_words(Split::DeepSeek, s), regex_words(&DEEPSEEK, s));
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        #[test]
        fn the_scans_split_as_the_regexes_do(s in "[ \t\r\n\u{a0}\u{3000}\u{2028}\u{200b}'sStTrReEvVmMlLdDſK a-c0-9٣²Ⅻ.,!?$+^\u{301}é数据かゞ゛・ー😀-]{0,24}") {
            check(&s)?;
        }

        #[test]
        fn any_text_splits_as_the_regexes_do(s in "\\PC{0,16}|\\p{Any}{0,16}") {
            check(&s)?;
        }
    }
}
