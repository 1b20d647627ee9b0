//! `meshnet-peer tokenize`: one JSON string per line of standard input in, its token ids as
//! one JSON array per line out, with the model's own tokenizer (GGUF files, vocabulary-only
//! ones included, or a GPT-2 directory's `tokenizer.json`).

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use meshnet_model::{EncodeOptions, GPT2_TOKENIZER_FILE, ModelTokenizer};

/// What `tokenize` is asked.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF file (a vocabulary-only one works) or GPT-2 directory.
    #[arg(long)]
    model: PathBuf,
    /// Add BOS/EOS as the file says (`tokenizer.ggml.add_bos_token`, `add_eos_token`).
    #[arg(long)]
    add_special: bool,
    /// Read control tokens written in the text (`<|im_start|>`) as their ids; without it they
    /// are plain text.
    #[arg(long)]
    parse_special: bool,
}

/// Runs `tokenize` on standard input and output.
pub fn tokenize(args: &TokenizeArgs) -> Result<()> {
    let tokenizer = if args.model.is_dir() {
        ModelTokenizer::from_tokenizer_json(args.model.join(GPT2_TOKENIZER_FILE))?
    } else {
        ModelTokenizer::from_gguf_file(&args.model)?
    };
    let options = EncodeOptions {
        add_special: args.add_special,
        parse_special: args.parse_special,
    };
    let mut output = BufWriter::new(std::io::stdout().lock());
    encode_lines(std::io::stdin().lock(), &mut output, |text| {
        Ok(tokenizer.encode_with(text, options)?)
    })
}

/// Encodes each line of `input` (a JSON string) and writes its ids to `output` as a JSON
/// array; a line that is not a JSON string is an error naming its number (from 1).
fn encode_lines(
    input: impl BufRead,
    output: &mut impl Write,
    encode: impl Fn(&str) -> Result<Vec<u32>>,
) -> Result<()> {
    for (index, line) in input.lines().enumerate() {
        let number = index + 1;
        let line = line.with_context(|| format!("reading line {number} of standard input"))?;
        let text: String = serde_json::from_str(&line)
            .map_err(|error| anyhow!("line {number} is not a JSON string: {error}"))?;
        let ids = encode(&text).with_context(|| format!("encoding line {number}"))?;
        writeln!(output, "{}", serde_json::to_string(&ids)?)?;
    }
    output.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Code points as ids.
    fn code_points(text: &str) -> Result<Vec<u32>> {
        Ok(text.chars().map(u32::from).collect())
    }

    fn run(input: &str) -> Result<String> {
        let mut output = Vec::new();
        encode_lines(input.as_bytes(), &mut output, code_points)?;
        Ok(String::from_utf8(output)?)
    }

    #[test]
    fn each_json_string_line_becomes_one_json_array_line() {
        assert_eq!(
            run("\"ab\"\n\"\"\n\"\\n\\u00e9\"\n").unwrap(),
            "[97,98]\n[]\n[10,233]\n"
        );
    }

    #[test]
    fn a_line_that_is_not_a_json_string_is_an_error_naming_its_number() {
        for bad in ["\"ok\"\n42\n", "\"ok\"\nplain text\n", "\"ok\"\n\n"] {
            let error = run(bad).unwrap_err().to_string();
            assert!(error.starts_with("line 2 is not a JSON string"), "{error}");
        }
    }
}
