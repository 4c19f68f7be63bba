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

/// Whether the GGUF header's `general.alignment` (its last entry, as candle's map keeps it) is
/// a zero that candle reads as the alignment (an unsigned or non-negative integer of up to 32
/// bits): the metadata walked, values skipped, nothing kept. False for a header it cannot walk
/// (candle then reports what is wrong with it).
fn zero_alignment(file: &mut File, len: u64) -> bool {
    use std::io::{BufReader, Error, ErrorKind};
    struct Walk<'a> {
        r: BufReader<&'a mut File>,
        pos: u64,
        len: u64,
        wide: bool,
    }
    impl Walk<'_> {
        fn bytes<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
            let mut b = [0u8; N];
            self.r.read_exact(&mut b)?;
            self.pos += N as u64;
            Ok(b)
        }
        fn u32(&mut self) -> std::io::Result<u32> {
            Ok(u32::from_le_bytes(self.bytes()?))
        }
        /// A count or string length: 32 bits in GGUF v1, 64 after.
        fn length(&mut self) -> std::io::Result<u64> {
            if self.wide {
                Ok(u64::from_le_bytes(self.bytes()?))
            } else {
                Ok(self.u32()? as u64)
            }
        }
        fn skip(&mut self, n: u64) -> std::io::Result<()> {
            let end = self.pos.checked_add(n).filter(|&e| e <= self.len);
            let Some(end) = end else {
                return Err(Error::from(ErrorKind::UnexpectedEof));
            };
            let step = i64::try_from(n).map_err(|_| Error::from(ErrorKind::InvalidData))?;
            self.r.seek_relative(step)?;
            self.pos = end;
            Ok(())
        }
        /// Skips one value of GGUF type `ty`.
        fn value(&mut self, ty: u32, depth: usize) -> std::io::Result<()> {
            let fixed = |t: u32| match t {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            };
            match ty {
                8 => {
                    let n = self.length()?;
                    self.skip(n)
                }
                9 if depth < 8 => {
                    let elem = self.u32()?;
                    let n = self.length()?;
                    match fixed(elem) {
                        Some(size) => self.skip(
                            n.checked_mul(size)
                                .ok_or_else(|| Error::from(ErrorKind::InvalidData))?,
                        ),
                        // Each element reads at least its length prefix: a count past the
                        // file's end stops at it.
                        None => (0..n).try_for_each(|_| self.value(elem, depth + 1)),
                    }
                }
                t => match fixed(t) {
                    Some(size) => self.skip(size),
                    None => Err(Error::from(ErrorKind::InvalidData)),
                },
            }
        }
    }
    let mut walk = || -> std::io::Result<bool> {
        file.seek(SeekFrom::Start(0))?;
        let mut w = Walk {
            r: BufReader::new(&mut *file),
            pos: 0,
            len,
            wide: true,
        };
        let magic = w.u32()?;
        if magic != 0x4655_4747 && magic != 0x4747_5546 {
            return Ok(false);
        }
        w.wide = match w.u32()? {
            1 => false,
            2 | 3 => true,
            _ => return Ok(false),
        };
        let _tensors = w.length()?;
        let kvs = w.length()?;
        let mut zero = false;
        for _ in 0..kvs {
            let n = w.length()?;
            let is_alignment = if n <= 64 {
                let mut key = vec![0u8; n as usize];
                w.r.read_exact(&mut key)?;
                w.pos += n;
                while key.last() == Some(&0) {
                    key.pop();
                }
                key == b"general.alignment"
            } else {
                w.skip(n)?;
                false
            };
            let ty = w.u32()?;
            if !is_alignment {
                w.value(ty, 0)?;
                continue;
            }
            // As candle reads it: these types give the alignment, any other the default.
            zero = match ty {
                0 | 1 => w.bytes::<1>()? == [0],
                2 | 3 => w.bytes::<2>()? == [0; 2],
                4 | 5 => w.bytes::<4>()? == [0; 4],
                t => {
                    w.value(t, 0)?;
                    false
                }
            };
        }
        Ok(zero)
    };
    walk().unwrap_or(false)
}

/// Two tensors whose data share bytes, described: one writer's mistake (or a crafted file) that
/// would give two weights the same bytes, silently. A tensor whose size overflows is left to
/// [`GgufFile::read`], which refuses it.
fn overlap(content: &gguf_file::Content) -> Option<String> {
    let mut spans: Vec<(u64, u64, &str)> = content
        .tensor_infos
        .iter()
        .filter_map(|(name, t)| {
            let elems = t
                .shape
                .dims()
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let dt = t.ggml_dtype;
            let bytes = elems
                .div_ceil(dt.block_size())
                .checked_mul(dt.type_size())?;
            let end = t.offset.checked_add(u64::try_from(bytes).ok()?)?;
            (end > t.offset).then_some((t.offset, end, name.as_str()))
        })
        .collect();
    spans.sort_unstable();
    let w = spans.windows(2).find(|w| w[1].0 < w[0].1)?;
    Some(format!(
        "tensors `{}` and `{}` share bytes {}..{} of the tensor data",
        w[0].2,
        w[1].2,
        w[1].0,
        w[0].1.min(w[1].1)
    ))
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
        // inside it (and the panic hook prints a trace before any error), so the header is
        // checked for one first.
        if zero_alignment(&mut file, file_len) {
            return Err(corrupt(
                "not a valid GGUF file (its general.alignment is 0; tensor data is aligned \
                 to a positive number of bytes, 32 by default)"
                    .into(),
            ));
        }
        file.seek(SeekFrom::Start(0))?;
        // What the check above could not walk (a header candle refuses anyway, nesting past
        // its limit) still cannot take the process down.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gguf_file::Content::read(&mut file)
        }));
        let content = match read {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(corrupt(format!(
                    "not a valid GGUF file ({})",
                    crate::error::candle_message(&e)
                )));
            }
            Err(_) => {
                return Err(corrupt(
                    "not a valid GGUF file (its header made the reader fail; \
                     a zero general.alignment?)"
                        .into(),
                ));
            }
        };
        if let Some(m) = overlap(&content) {
            return Err(corrupt(m));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Value;

    /// A GGUF of metadata alone: a string array ahead of `general.alignment`, the walk skips it.
    fn write(name: &str, alignment: Option<Value>) -> PathBuf {
        let words = Value::Array(["a", "bc", ""].map(|s| Value::String(s.into())).to_vec());
        let nums = Value::Array(vec![Value::U32(1), Value::U32(2)]);
        let arch = Value::String("llama".into());
        let mut md: Vec<(&str, &Value)> =
            vec![("tokenizer.ggml.tokens", &words), ("some.numbers", &nums)];
        if let Some(a) = &alignment {
            md.push(("general.alignment", a));
        }
        md.push(("general.architecture", &arch));
        let p = std::env::temp_dir().join(format!(
            "dspark-gguf-unit-{}-{name}.gguf",
            std::process::id()
        ));
        let mut f = File::create(&p).unwrap();
        gguf_file::write(&mut f, &md, &[]).unwrap();
        p
    }

    #[test]
    fn a_zero_alignment_is_a_corrupt_file_not_a_panic() {
        for (name, a) in [
            ("u32", Value::U32(0)),
            ("u8", Value::U8(0)),
            ("i32", Value::I32(0)),
        ] {
            let p = write(name, Some(a));
            let e = match GgufFile::open(&p) {
                Ok(_) => panic!("{name}: opened"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("general.alignment is 0") && e.contains(&*p.to_string_lossy()),
                "{name}: {e}"
            );
            let _ = std::fs::remove_file(&p);
        }
        // Alignments candle reads (a positive one, one it ignores for the default, none): the
        // file opens, its metadata read past the walked header.
        for (name, a) in [
            ("32", Some(Value::U32(32))),
            ("u64", Some(Value::U64(0))),
            ("negative", Some(Value::I32(-1))),
            ("none", None),
        ] {
            let p = write(name, a);
            let g = GgufFile::open(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(g.meta_str("general.architecture").as_deref(), Some("llama"));
            let _ = std::fs::remove_file(&p);
        }
    }

    #[test]
    fn tensors_sharing_bytes_are_refused() {
        use candle_core::quantized::QTensor;
        let p = std::env::temp_dir().join(format!(
            "dspark-gguf-unit-{}-overlap.gguf",
            std::process::id()
        ));
        let t = |v: f32| {
            let t = candle_core::Tensor::full(v, 8, &candle_core::Device::Cpu).unwrap();
            QTensor::quantize(&t, GgmlDType::F32).unwrap()
        };
        let (a, b) = (t(1.0), t(2.0));
        let mut f = File::create(&p).unwrap();
        gguf_file::write(&mut f, &[], &[("tensor.alpha", &a), ("tensor.beta", &b)]).unwrap();
        drop(f);
        let mut g = GgufFile::open(&p).unwrap();
        assert_eq!(
            g.read("tensor.beta").unwrap().data,
            2f32.to_le_bytes().repeat(8)
        );
        // `tensor.beta`'s data offset (after its name, 1 dim, the dim and its type) moved
        // to 16: its first 16 bytes are `tensor.alpha`'s last.
        let mut bytes = std::fs::read(&p).unwrap();
        let name = b"tensor.beta";
        let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        let off = at + 4 + 8 + 4;
        assert_eq!(bytes[off..off + 8], 32u64.to_le_bytes());
        bytes[off..off + 8].copy_from_slice(&16u64.to_le_bytes());
        std::fs::write(&p, bytes).unwrap();
        let e = match GgufFile::open(&p) {
            Ok(_) => panic!("opened"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("tensor.alpha") && e.contains("tensor.beta") && e.contains("16..32"),
            "{e}"
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_header_candle_refuses_is_reported_without_a_backtrace() {
        let p =
            std::env::temp_dir().join(format!("dspark-gguf-unit-{}-v9.gguf", std::process::id()));
        let mut b = 0x4655_4747u32.to_le_bytes().to_vec();
        b.extend(9u32.to_le_bytes());
        b.extend([0u8; 16]);
        std::fs::write(&p, b).unwrap();
        let e = match GgufFile::open(&p) {
            Ok(_) => panic!("opened"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("not a valid GGUF") && e.contains("version"),
            "{e}"
        );
        // With RUST_BACKTRACE set candle attaches a backtrace; none reaches the message.
        assert!(!e.contains("\n"), "{e}");
        let _ = std::fs::remove_file(&p);
    }
}
