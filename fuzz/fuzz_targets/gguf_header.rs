//! Fuzzes reading a GGUF file's header (untrusted bytes: any model file a volunteer downloads):
//! meshnet's bounds-checked walk, then candle's reader, as `GgufModel::open` runs them.
//!
//! Neither may panic or allocate beyond what the input's size allows. When the walk accepts a
//! header, candle's reader must read it too and agree on where tensor data starts and on every
//! tensor's dims, type and offset, and every tensor must then read from the input.

#![no_main]

use std::io::Cursor;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::Content;
use libfuzzer_sys::fuzz_target;
use meshnet_model::{check_gguf_layout, loadable_type, read_gguf_header};

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    // The full path of `GgufModel::open`, declared-size checks included.
    let opened = read_gguf_header(&mut Cursor::new(data), path);
    let Ok(layout) = check_gguf_layout(&mut &data[..], data.len() as u64, path) else {
        assert!(opened.is_err(), "read_gguf_header accepted what the walk refused");
        return;
    };
    let mut reader = Cursor::new(data);
    let content = Content::read(&mut reader).expect("candle reads a header the walk accepted");
    assert_eq!(content.tensor_data_offset, layout.tensor_data_offset);
    assert_eq!(content.tensor_infos.len(), layout.tensors.len());
    for tensor in &layout.tensors {
        let info = &content.tensor_infos[&tensor.name];
        let dims: Vec<u64> = info.shape.dims().iter().rev().map(|&d| d as u64).collect();
        assert_eq!(dims, tensor.dims, "{}", tensor.name);
        assert_eq!(Some(info.ggml_dtype), loadable_type(tensor.type_id));
        assert_eq!(info.offset, tensor.offset);
        content
            .tensor(&mut reader, &tensor.name, &Device::Cpu)
            .expect("a tensor the walk accepted reads");
    }
});
