use std::path::PathBuf;
use std::sync::LazyLock;

use proptest::prelude::*;

use super::*;

/// The tokenizer files `just setup` unpacks for the tests.
pub(crate) fn family_dir(family: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/tokenizers").join(family);
    assert!(dir.join("tokenizer.json").is_file(), "{} is missing: run `just setup`", dir.display());
    dir
}

/// The tokenizer families `just setup` fetches.
pub(crate) const FAMILIES: [&str; 4] = ["qwen3", "llama3_1", "gemma3", "deepseek_v3"];

fn whole(tok: &Tokenizer, text: &str) -> Vec<u32> {
    match &tok.encoder {
        Encoder::Hf { tok, .. } => tok.encode_fast(text, false).unwrap().get_ids().to_vec(),
        Encoder::Sim => unreachable!(),
    }
}

#[test]
fn special_tokens_and_bos_come_from_the_config() {
    let llama = Tokenizer::load(family_dir("llama3_1").to_str().unwrap(), 0).unwrap();
    assert!(llama.special.named.iter().any(|(n, t)| *n == "bos_token" && t == "<|begin_of_text|>"));
    assert_eq!(llama.added.0, vec![128_000]);
    let qwen = Tokenizer::load(family_dir("qwen3").to_str().unwrap(), 0).unwrap();
    assert!(qwen.added.0.is_empty(), "Qwen adds no BOS");
    let deepseek = Tokenizer::load(family_dir("deepseek_v3").to_str().unwrap(), 0).unwrap();
    assert!(deepseek.special.named.iter().any(|(n, t)| *n == "bos_token" && t == "<｜begin▁of▁sentence｜>"), "AddedToken objects read");
    assert!(deepseek.added.0.is_empty(), "transformers 5 ignores add_bos_token when tokenizer.json exists");
}

#[test]
fn a_cached_chunk_gives_the_same_ids() {
    let tok = Tokenizer::load(family_dir("qwen3").to_str().unwrap(), 10_000).unwrap();
    let system = format!("<|im_start|>system\n{}<|im_end|>\n", "You are a careful assistant. ".repeat(40));
    let a = format!("{system}<|im_start|>user\nfirst<|im_end|>\n");
    let b = format!("{system}<|im_start|>user\nsecond<|im_end|>\n");
    let cold = tok.encode(&a, false);
    assert!(tok.cached_tokens() > 200, "the long system chunk is kept");
    assert_eq!(cold, whole(&tok, &a));
    assert_eq!(tok.encode(&b, false), whole(&tok, &b));
    assert_eq!(tok.encode(&a, false), cold);
}

#[test]
fn the_cache_keeps_to_its_budget() {
    let tok = Tokenizer::load(family_dir("qwen3").to_str().unwrap(), 300).unwrap();
    for i in 0..20 {
        tok.encode(&format!("<|im_start|>{}", format!("chunk {i} ").repeat(60)), false);
        assert!(tok.cached_tokens() <= 300);
    }
    assert!(tok.cached_tokens() > 0);
}

#[test]
fn a_missing_cache_entry_is_an_error_not_a_download() {
    let err = Tokenizer::load("hf:nobody/not-a-model", 0).unwrap_err();
    assert!(matches!(err, LoadError::NotCached(..)), "{err}");
}

/// Text pieces that stress the chunking: special tokens of every family, whitespace around them, unicode.
fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ a-zA-Z\n\t]{0,12}",
        "\\PC{0,6}",
        "[ \t\r\n\u{a0}\u{3000}'sStTrReEvVlLdDſ a-c0-9٣²Ⅻ.,!\u{301}e\u{308}é数据😀-]{0,16}",
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<|begin_of_text|>".to_owned()),
        Just("<|eot_id|>".to_owned()),
        Just("<start_of_turn>".to_owned()),
        Just("<end_of_turn>".to_owned()),
        Just("<bos>".to_owned()),
        Just("<｜User｜>".to_owned()),
        Just("<｜begin▁of▁sentence｜>".to_owned()),
        Just("<think>".to_owned()),
        Just("  \n".to_owned()),
    ]
}

static ALL: LazyLock<Vec<Tokenizer>> =
    LazyLock::new(|| FAMILIES.iter().map(|f| Tokenizer::load(family_dir(f).to_str().unwrap(), 1_000_000).unwrap()).collect());

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn chunked_encoding_equals_whole_encoding(pieces in proptest::collection::vec(piece(), 0..24)) {
        let text: String = pieces.concat();
        for (family, tok) in FAMILIES.iter().zip(ALL.iter()) {
            prop_assert_eq!(tok.encode(&text, false), whole(tok, &text), "{}", family);
        }
    }
}

#[test]
fn long_words_encode_as_the_hugging_face_pipeline_does() {
    // One 'word' of 6,000 letters, a run of one letter, and a long punctuation run: they must encode as the Hugging Face pipeline does (the heap merge's speed is in the benchmark).
    let mut state = 7u64;
    let letters: String = (0..6_000)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            char::from(b'a' + (state >> 59) as u8 % 26)
        })
        .collect();
    let text = format!("{letters} {} {}", "a".repeat(3_000), "=-".repeat(1_500));
    for family in ["qwen3", "llama3_1"] {
        let tok = Tokenizer::load(family_dir(family).to_str().unwrap(), 0).unwrap();
        assert_eq!(tok.encode(&text, false), whole(&tok, &text), "{family}");
    }
}

#[test]
fn gemma_words_split_only_where_no_token_spans() {
    // Gemma has a token for "> </": a word boundary before that space would lose it.
    let tok = Tokenizer::load(family_dir("gemma3").to_str().unwrap(), 0).unwrap();
    for text in [
        "a> </b",
        "\n> </p> and <b> </b>",
        "a  b   c    d",
        "   leading and trailing   ",
        "\n\n  indented\n\tcode()  {\n    return x;\n}",
        "unknown \u{10FFFD} characters \u{E000} fall back to bytes",
        "naïve café — «quotes» 数据 😀 done",
    ] {
        assert_eq!(tok.encode(text, false), whole(&tok, text), "{text:?}");
    }
}

/// Words and gaps that make many places to cut, and some that must not be cut at.
fn prose() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            "[a-zA-Z]{1,9}",
            Just(" ".to_owned()),
            Just("  ".to_owned()),
            Just("\n".to_owned()),
            "[0-9]{1,5}",
            "[.,;'!?-]{1,2}",
            Just("'s".to_owned()),
            Just(" \u{301}".to_owned()),
            Just("e\u{308}".to_owned()),
            Just("数据".to_owned()),
            Just("<think>".to_owned()),
            Just("<|im_start|>".to_owned()),
        ],
        0..200,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pieces_cut_where_words_are_cut_encode_to_the_ids_of_the_whole(text in prose()) {
        let cut: Vec<&str> = pieces(&text, 2).collect();
        prop_assert_eq!(cut.concat(), text.clone());
        for (family, tok) in FAMILIES.iter().zip(ALL.iter()) {
            let Encoder::Hf { fast: Some(fast), .. } = &tok.encoder else { continue };
            if !fast.cuts_at_spaces() {
                continue;
            }
            let mut ids = Vec::new();
            for piece in &cut {
                fast.encode(piece, &mut ids);
            }
            let mut whole_fast = Vec::new();
            fast.encode(&text, &mut whole_fast);
            prop_assert_eq!(&ids, &whole_fast, "{}", family);
        }
    }
}

/// Draws below `n`, seeded: a linear congruential generator.
fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |n| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % n
    }
}

/// A word of three to eight random lowercase letters.
fn random_word(next: &mut impl FnMut(u64) -> u64) -> String {
    (0..3 + next(6)).map(|_| char::from(b'a' + next(26) as u8)).collect()
}

#[test]
fn a_long_passage_is_cut_the_same_way_after_any_prefix_and_its_pieces_hit_the_cache() {
    // Words of random letters: English has as many different places to cut.
    let mut next = draws(11);
    let passage: String = (0..4_000).map(|_| random_word(&mut next) + " ").collect::<String>() + "end";
    let a = format!("request one {passage}");
    let b = format!("another request, number two: {passage}");
    let tail = |text: &str| pieces(text, CUT_ONE_IN).skip(1).map(str::to_owned).collect::<Vec<_>>();
    let (ta, tb) = (tail(&a), tail(&b));
    assert!(ta.len() > 5, "a 25 KB passage is cut into pieces");
    assert_eq!(ta[1..], tb[1..], "past the first cut, the same pieces");
    let tok = Tokenizer::load(family_dir("qwen3").to_str().unwrap(), 1_000_000).unwrap();
    assert_eq!(tok.encode(&a, false), whole(&tok, &a));
    let kept = tok.cached_tokens();
    assert_eq!(tok.encode(&b, false), whole(&tok, &b));
    assert!(
        tok.cached_tokens() - kept < kept / 4,
        "the second text's pieces were mostly in the cache: {kept} then {}",
        tok.cached_tokens()
    );
}

#[test]
fn a_text_of_few_distinct_words_is_cut_as_often_as_any() {
    // Sixty-four words, as in the benchmarks' filler: few distinct windows before a space.
    let mut next = draws(5);
    let words: Vec<String> = (0..64).map(|_| random_word(&mut next)).collect();
    let text = (0..36_000).map(|_| words[next(64) as usize].as_str()).collect::<Vec<_>>().join(" ");
    let cuts = pieces(&text, CUT_ONE_IN).count() - 1;
    // About 36,000 places to cut, one in 256 of them a cut.
    assert!((36_000 / 512..36_000 / 128).contains(&cuts), "{cuts} cuts");
}

#[test]
fn special_positions_are_the_turn_markers() {
    let text = "<|im_start|>user\nhi <there>|<|im_end|>\n<|im_start|>assistant\n";
    let qwen = Tokenizer::load(family_dir("qwen3").to_str().unwrap(), 0).unwrap();
    let ids = qwen.encode(text, false);
    let at = qwen.special_positions(&ids);
    assert_eq!(at.len(), 3, "{ids:?}");
    assert!(at.iter().all(|&i| qwen.decode(ids[i]).is_some_and(|t| t.starts_with("<|im_"))));
    let sim = Tokenizer::load("builtin:sim", 0).unwrap();
    let ids = sim.encode(text, false);
    let at = sim.special_positions(&ids);
    assert_eq!(at.len(), 3, "a lone `<` or `|` is not a marker: {ids:?}");
    assert_eq!(at[0], 0);
}
