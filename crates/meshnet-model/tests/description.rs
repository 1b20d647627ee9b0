#![allow(clippy::unwrap_used)]
//! The model description and the tokenizer read from the default model's GGUF metadata.

mod common;

use meshnet_model::{ChatMessage, ChatTemplate};
use meshnet_types::Quantization;

#[test]
fn describes_smollm2_from_metadata() {
    let description = common::model().description();
    assert_eq!(description.architecture, "llama");
    assert_eq!(description.layers, 30);
    assert_eq!(description.hidden, 576);
    assert_eq!(description.heads, 9);
    assert_eq!(description.kv_heads, 3);
    assert_eq!(description.head_dim, 64);
    assert_eq!(description.vocab_size, 49152);
    assert_eq!(description.im_start_token, Some(1));
    assert_eq!(description.im_end_token, Some(2));
    assert!(description.tied_embeddings);
    assert!(
        description
            .chat_template
            .as_deref()
            .unwrap()
            .contains("<|im_start|>")
    );
    let shipped = description.weight_bytes(None).unwrap();
    let q8 = description.weight_bytes(Some(Quantization::Q8_0)).unwrap();
    assert_eq!(shipped.layers.len(), 30);
    assert!(
        shipped
            .layers
            .iter()
            .all(|&bytes| bytes > 1_000_000 && bytes == shipped.layers[0])
    );
    // Q8_0 takes 34 bytes per 32 values, Q4_1 20.
    assert!(q8.layers[0] > shipped.layers[0]);
    println!("{}", serde_json::to_string_pretty(description).unwrap());
}

#[test]
fn tokenizer_round_trips_without_a_prefix_space() {
    let tokenizer = common::tokenizer();
    let ids = tokenizer.encode("Hello").unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(tokenizer.decode(&ids).unwrap(), "Hello");
    let text = "Hello, world! 12345 times.";
    assert_eq!(
        tokenizer.decode(&tokenizer.encode(text).unwrap()).unwrap(),
        text
    );
    // Digits are split one by one.
    assert_eq!(tokenizer.encode("12345").unwrap().len(), 5);
}

#[test]
fn chat_markers_are_single_tokens() {
    let tokenizer = common::tokenizer();
    let template = ChatTemplate::from_jinja(
        common::model()
            .description()
            .chat_template
            .as_deref()
            .unwrap(),
    )
    .unwrap();
    let text = template.render(&[ChatMessage::user("Hi there")]).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        template
            .clone()
            .without_default_system()
            .render(&[ChatMessage::user("Hi there")])
            .unwrap(),
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tokenizer.encode(&text).unwrap();
    assert_eq!(ids[0], 1, "{ids:?}");
    assert!(ids.contains(&2));
    assert_eq!(
        ids.iter().filter(|&&id| id == 1).count(),
        3,
        "system, user, assistant"
    );
    assert_eq!(tokenizer.token_id("<|im_end|>"), Some(2));
}

#[test]
fn generation_ends_on_every_token_llama_cpp_lists_for_smollm2() {
    let tokenizer = common::tokenizer();
    // `<|endoftext|>` and `<|im_end|>` by their text (2 is also the EOS id), and
    // `<reponame>` as the fill-in-the-middle repository token.
    assert_eq!(tokenizer.end_of_generation(), [0, 2, 4]);
    assert_eq!(tokenizer.end_of_turn(), Some(2));
    let text = meshnet_model::TextSide::of(
        &meshnet_model::Model::open(&common::model_path()).unwrap(),
        None,
    )
    .unwrap();
    assert_eq!(text.stop_tokens, [0, 2, 4]);
    assert_eq!(text.end_of_turn, Some(2));
}

/// SmolLM2's tokenizer as a Hugging Face pipeline, built from the GGUF metadata: BPE over
/// `tokenizer.ggml.tokens`/`merges`, digits split one by one then GPT-2's byte-level split,
/// and the control tokens registered as special tokens.
fn hugging_face_tokenizer_of_the_default_model() -> tokenizers::Tokenizer {
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;

    let metadata = &common::model().content().metadata;
    let strings = |key: &str| -> Vec<String> {
        metadata[key]
            .to_vec()
            .unwrap()
            .iter()
            .map(|value| value.to_string().unwrap().clone())
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let types = metadata["tokenizer.ggml.token_type"].to_vec().unwrap();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), id as u32))
        .collect();
    let merges = strings("tokenizer.ggml.merges")
        .iter()
        .map(|merge| {
            let (left, right) = merge.split_once(' ').unwrap();
            (left.to_owned(), right.to_owned())
        })
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]))));
    tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
    let control: Vec<tokenizers::AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, kind)| kind.to_i32().unwrap() == 3)
        .map(|(token, _)| tokenizers::AddedToken::from(token.clone(), true))
        .collect();
    tokenizer.add_special_tokens(control).unwrap();
    tokenizer
}

#[test]
fn a_saved_tokenizer_json_loads_and_encodes_the_same() {
    let from_gguf = common::tokenizer();
    let dir = std::env::temp_dir().join(format!("meshnet-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    hugging_face_tokenizer_of_the_default_model()
        .save(&path, false)
        .unwrap();
    let from_json = meshnet_model::ModelTokenizer::from_tokenizer_json(&path).unwrap();
    let text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n";
    assert_eq!(
        from_json.encode(text).unwrap(),
        from_gguf.encode(text).unwrap()
    );
    // Special tokens as plain text: both read "<|im_end|>" as characters.
    let plain = meshnet_model::EncodeOptions::default();
    let ours = from_gguf.encode_with(text, plain).unwrap();
    assert_eq!(from_json.encode_with(text, plain).unwrap(), ours);
    assert!(!ours.contains(&2), "{ours:?}");
    assert_eq!(from_json.eos_token(), from_json.token_id("<|endoftext|>"));

    std::fs::write(&path, b"{ not json").unwrap();
    let err = meshnet_model::ModelTokenizer::from_tokenizer_json(&path).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    let err = meshnet_model::ModelTokenizer::from_tokenizer_json(&path).unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
}
