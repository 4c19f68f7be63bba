//! GGUF reading: metadata through candle's parser, tensor bytes read directly so the runtime can
//! repack them into its own block formats.

use crate::{Result, RuntimeError};
use candle_core::quantized::{GgmlDType, gguf_file};
use kernels::GgmlType;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    file: File,
    file_len: u64,
}

/// A tensor's raw bytes plus its type and row-major dims (outermost first).
pub struct RawTensor {
    pub ty: GgmlType,
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

impl RawTensor {
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

pub fn ggml_type(name: &str, dt: GgmlDType) -> Result<GgmlType> {
    Ok(match dt {
        GgmlDType::F32 => GgmlType::F32,
        GgmlDType::F16 => GgmlType::F16,
        GgmlDType::Q4_1 => GgmlType::Q4_1,
        GgmlDType::Q5_0 => GgmlType::Q5_0,
        GgmlDType::Q8_0 => GgmlType::Q8_0,
        GgmlDType::Q4K => GgmlType::Q4K,
        GgmlDType::Q6K => GgmlType::Q6K,
        other => {
            return Err(RuntimeError::UnsupportedQuant {
                tensor: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(RuntimeError::NotFound(path.display().to_string()));
        }
        let mut file = File::open(path)?;
        let file_len = file.metadata()?.len();
        let corrupt = |reason: String| RuntimeError::Corrupt {
            path: path.display().to_string(),
            reason,
        };
        // candle's reader divides by the file's `general.alignment`: a zero there panics
        // inside it, so the panic is caught and reported as the corrupt file it is.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gguf_file::Content::read(&mut file)
        }));
        let content = match read {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(corrupt(format!("not a valid GGUF file ({e})"))),
            Err(_) => {
                return Err(corrupt(
                    "not a valid GGUF file (its header made the reader fail; \
                     a zero general.alignment?)"
                        .into(),
                ));
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            content,
            file,
            file_len,
        })
    }

    pub fn meta(&self, key: &str) -> Option<&gguf_file::Value> {
        self.content.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Option<String> {
        self.meta(key).and_then(|v| v.to_string().ok()).cloned()
    }

    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        use gguf_file::Value::*;
        match self.meta(key)? {
            U8(v) => Some(*v as u64),
            // A negative count is no count (it would read as a huge one).
            I8(v) => u64::try_from(*v).ok(),
            U16(v) => Some(*v as u64),
            I16(v) => u64::try_from(*v).ok(),
            U32(v) => Some(*v as u64),
            I32(v) => u64::try_from(*v).ok(),
            U64(v) => Some(*v),
            I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    pub fn meta_f32(&self, key: &str) -> Option<f32> {
        use gguf_file::Value::*;
        match self.meta(key)? {
            F32(v) => Some(*v),
            F64(v) => Some(*v as f32),
            _ => None,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn read(&mut self, name: &str) -> Result<RawTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))?;
        let ty = ggml_type(name, info.ggml_dtype)?;
        let dims = info.shape.dims().to_vec();
        // Checked: dims and offsets come from the file, and a wrapped product or sum would
        // pass the end-of-file check below.
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| self.corrupt(format!("tensor `{name}` has too many elements")))?;
        if !elems.is_multiple_of(ty.block_elems()) {
            return Err(self.corrupt(format!(
                "tensor `{name}` has {elems} elements, not a multiple of its block"
            )));
        }
        let bytes = (elems / ty.block_elems()).checked_mul(ty.block_bytes());
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let (Some(bytes), Some(start)) = (bytes, start) else {
            return Err(self.corrupt(format!("tensor `{name}` lies past any file")));
        };
        if start.saturating_add(bytes as u64) > self.file_len {
            return Err(self.corrupt(format!(
                "tensor `{name}` runs past the end of the file (truncated download?)"
            )));
        }
        let mut data = vec![0u8; bytes];
        self.file.seek(SeekFrom::Start(start))?;
        self.file.read_exact(&mut data)?;
        Ok(RawTensor { ty, dims, data })
    }

    fn corrupt(&self, reason: String) -> RuntimeError {
        RuntimeError::Corrupt {
            path: self.path.display().to_string(),
            reason,
        }
    }
}
