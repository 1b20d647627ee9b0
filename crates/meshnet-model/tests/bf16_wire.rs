#![allow(clippy::unwrap_used)]
//! The bfloat16 wire, honestly: separate span objects joined by the real frame codec equal
//! the single-process reference that makes the same bf16 casts, token for token; and how
//! often the bf16 split changes the text of the unsplit model is measured and printed.

mod common;

use candle_core::{Device, Tensor};
use meshnet_model::{
    BoundaryPolicy, DEFAULT_KV_BUDGET_BYTES, GenerationRequest, LlamaSpan, Route, SessionId,
    SpanSpec, SplitModel, Stage, generate,
};
use meshnet_types::{LayerSpan, Quantization};
use meshnet_wire::{ActivationFrame, Activations, Encoding, FrameMeta, Limits, Route as WireRoute};

/// A span reached over the wire: hidden states are encoded into a real activation frame
/// (bf16, zstd), decoded, and handed to the span, as the receiving peer would.
struct OverTheWire<'a> {
    span: &'a LlamaSpan,
}

impl Stage for OverTheWire<'_> {
    fn forward(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> meshnet_model::Result<Tensor> {
        let layers = self.span.layers();
        let frame = ActivationFrame {
            meta: FrameMeta {
                session,
                chunk_index: 0,
                chunk_total: 1,
                position: position as u64,
                layers,
                route: WireRoute::default(),
            },
            activations: Activations::from_tensor(&hidden)?,
        };
        let encoded = frame.encode(Encoding::Zstd);
        let decoded = ActivationFrame::decode(&encoded.headers, &encoded.body, &Limits::default())?;
        assert_eq!(decoded.meta.position, position as u64);
        let received = decoded.activations.into_tensor(&Device::Cpu)?;
        let output = self.span.forward(session, position, received)?;
        // The answer travels back up the chain as another frame.
        let answer = ActivationFrame {
            meta: decoded.meta,
            activations: Activations::from_tensor(&output)?,
        }
        .encode(Encoding::Zstd);
        let returned = ActivationFrame::decode(&answer.headers, &answer.body, &Limits::default())?;
        Ok(returned.activations.into_tensor(&Device::Cpu)?)
    }

    fn end_session(&self, session: SessionId) {
        self.span.end_session(session);
    }

    fn name(&self) -> String {
        format!("{} over the wire", self.span.name())
    }
}

#[test]
fn codec_joined_spans_equal_the_bf16_reference_and_the_drift_is_reported() {
    let model = common::model();
    let quantization = Some(Quantization::Q8_0);
    let reference =
        SplitModel::load(model, &[10, 20], quantization, DEFAULT_KV_BUDGET_BYTES).unwrap();
    let reference_route = reference.route(BoundaryPolicy::Bf16).unwrap();

    let spec = |layers: std::ops::Range<u32>, embedding, head| SpanSpec {
        embedding,
        head,
        quantization,
        ..SpanSpec::layers(LayerSpan::new(layers.start, layers.end))
    };
    let entry = LlamaSpan::load(model, &spec(0..10, true, false)).unwrap();
    let middle = LlamaSpan::load(model, &spec(10..20, false, false)).unwrap();
    let exit = LlamaSpan::load(model, &spec(20..30, false, true)).unwrap();
    let middle_hop = OverTheWire { span: &middle };
    let exit_hop = OverTheWire { span: &exit };
    let wire_route = Route {
        embedder: &entry,
        stages: vec![&entry, &middle_hop, &exit_hop],
        head: &exit,
        // The codec itself casts to bf16.
        boundary: BoundaryPolicy::F32,
    };

    let unsplit = SplitModel::load(model, &[], quantization, DEFAULT_KV_BUDGET_BYTES).unwrap();
    let unsplit_route = unsplit.route(BoundaryPolicy::F32).unwrap();

    let steps = 64;
    let mut differing_prompts = 0;
    let mut differing_tokens = 0;
    let prompts = common::prompts();
    for (index, prompt) in prompts.iter().enumerate() {
        let request = GenerationRequest::greedy(prompt.clone(), steps);
        let expected = generate(&reference_route, &request, None).unwrap().tokens;
        let over_wire = generate(&wire_route, &request, None).unwrap().tokens;
        assert_eq!(
            over_wire, expected,
            "prompt {index}: wire route differs from reference"
        );
        assert_eq!(over_wire.len(), steps);

        let plain = generate(&unsplit_route, &request, None).unwrap().tokens;
        let first_difference = plain.iter().zip(&over_wire).position(|(a, b)| a != b);
        let tokenizer = common::tokenizer();
        match first_difference {
            None => println!("prompt {index}: bf16 split text equals unsplit text"),
            Some(step) => {
                differing_prompts += 1;
                differing_tokens += plain.iter().zip(&over_wire).filter(|(a, b)| a != b).count();
                println!(
                    "prompt {index}: bf16 split diverges from unsplit at step {step} of {steps}\n  \
                     unsplit: {:?}\n  split:   {:?}",
                    tokenizer.decode(&plain).unwrap(),
                    tokenizer.decode(&over_wire).unwrap()
                );
            }
        }
    }
    println!(
        "bf16 boundaries at layers 10 and 20 ({quantization:?}): {differing_prompts} of {} \
         prompts change text within {steps} greedy tokens; {differing_tokens} of {} token \
         positions differ",
        prompts.len(),
        prompts.len() * steps
    );
}
