//! Safetensors checkpoints read one tensor at a time, and of a tensor parallel rank's row
//! slice only those rows: loading never holds the whole checkpoint. (Reading every file
//! whole first made each rank of a tensor-parallel group hold the full checkpoint while it
//! built its part, and a single worker hold it beside its own f32 copy.)
//!
//! The format: an 8-byte little-endian header length, a JSON header naming each tensor's
//! dtype, shape and byte range after the header, then the bytes.

use crate::{Result, RuntimeError};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The format's own bound on a header (the reference implementation refuses larger ones).
const MAX_HEADER: u64 = 100_000_000;

#[derive(Clone, Debug)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    begin: u64,
    end: u64,
}

/// The dtypes a model may be stored in, and their sizes.
fn float_dtype(s: &str) -> Option<(DType, usize)> {
    match s {
        "F32" => Some((DType::F32, 4)),
        "F16" => Some((DType::F16, 2)),
        "BF16" => Some((DType::BF16, 2)),
        _ => None,
    }
}

/// Bytes per element of every dtype the format names (to check a header's ranges whatever it
/// holds: a checkpoint may carry integer buffers the model never reads).
fn dtype_size(s: &str) -> Option<usize> {
    Some(match s {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// A tensor's dtype, shape, and first and last stored bytes (see [`SafetensorsFile::ends`]).
pub type Ends = (String, Vec<usize>, Vec<u8>, Vec<u8>);

/// One `.safetensors` file: its header parsed, its bytes read on demand.
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    entries: HashMap<String, Entry>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let corrupt = |reason: String| RuntimeError::Corrupt {
            path: path.display().to_string(),
            reason,
        };
        let mut file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => RuntimeError::NotFound(path.display().to_string()),
            _ => corrupt(e.to_string()),
        })?;
        let len = file.metadata()?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|_| corrupt("shorter than a safetensors header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > len {
            return Err(corrupt(format!(
                "header of {n} bytes in a file of {len} bytes"
            )));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact(&mut text)
            .map_err(|e| corrupt(format!("header: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| corrupt(format!("header is not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| corrupt("header is not a JSON object".into()))?;
        let data = 8 + n;
        let mut entries = HashMap::with_capacity(obj.len());
        for (name, e) in obj {
            if name == "__metadata__" {
                continue;
            }
            let bad = |what: &str| corrupt(format!("tensor `{name}`: {what}"));
            let dtype = e["dtype"]
                .as_str()
                .ok_or_else(|| bad("no dtype"))?
                .to_string();
            let shape = e["shape"]
                .as_array()
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| bad("shape is not a list of sizes"))?;
            let offs = e["data_offsets"]
                .as_array()
                .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
                .ok_or_else(|| bad("no data_offsets pair"))?;
            let (begin, end) = (data.saturating_add(offs.0), data.saturating_add(offs.1));
            if offs.0 > offs.1 || end > len {
                return Err(bad(&format!(
                    "bytes {}..{} outside the file's {} after the header",
                    offs.0,
                    offs.1,
                    len - data
                )));
            }
            let elems = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
                .ok_or_else(|| bad("shape overflows"))?;
            if let Some(size) = dtype_size(&dtype)
                && elems.checked_mul(size as u64) != Some(offs.1 - offs.0)
            {
                return Err(bad(&format!(
                    "{dtype} of shape {shape:?} in {} bytes",
                    offs.1 - offs.0
                )));
            }
            entries.insert(
                name.clone(),
                Entry {
                    dtype,
                    shape,
                    begin,
                    end,
                },
            );
        }
        // Tensors whose bytes overlap are one writer's mistake (or a crafted file): reading
        // them would give two weights the same bytes, silently.
        let mut spans: Vec<(u64, u64, &str)> = entries
            .iter()
            .filter(|(_, e)| e.end > e.begin)
            .map(|(n, e)| (e.begin, e.end, n.as_str()))
            .collect();
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(corrupt(format!(
                "tensors `{}` and `{}` share bytes {}..{}",
                w[0].2,
                w[1].2,
                w[1].0 - data,
                w[0].1.min(w[1].1) - data
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    fn entry(&self, name: &str) -> Result<(Entry, DType, usize)> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))?;
        let (dt, size) = float_dtype(&e.dtype).ok_or_else(|| RuntimeError::UnsupportedQuant {
            tensor: name.to_string(),
            dtype: e.dtype.clone(),
        })?;
        Ok((e.clone(), dt, size))
    }

    fn bytes(&mut self, at: u64, n: usize) -> Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.file.seek(SeekFrom::Start(at))?;
        self.file
            .read_exact(&mut b)
            .map_err(|e| RuntimeError::Corrupt {
                path: self.path.display().to_string(),
                reason: e.to_string(),
            })?;
        Ok(b)
    }

    /// The whole tensor, as f32.
    pub fn read(&mut self, name: &str) -> Result<Tensor> {
        let (e, dt, _) = self.entry(name)?;
        let b = self.bytes(e.begin, (e.end - e.begin) as usize)?;
        Ok(Tensor::from_raw_buffer(&b, dt, &e.shape, &Device::Cpu)?.to_dtype(DType::F32)?)
    }

    /// Rows `a..b` of a matrix, as f32: only their bytes are read.
    pub fn read_rows(&mut self, name: &str, a: usize, b: usize) -> Result<Tensor> {
        let (e, dt, size) = self.entry(name)?;
        let (rows, cols) = match e.shape[..] {
            [r, c] => (r, c),
            _ => return Err(RuntimeError::Config(format!("`{name}` is not a matrix"))),
        };
        if a > b || b > rows {
            return Err(RuntimeError::Config(format!(
                "`{name}` is {rows}x{cols}, too small for rows {a}..{b}"
            )));
        }
        let row = (cols * size) as u64;
        let bytes = self.bytes(e.begin + a as u64 * row, (b - a) * cols * size)?;
        Ok(
            Tensor::from_raw_buffer(&bytes, dt, &[b - a, cols], &Device::Cpu)?
                .to_dtype(DType::F32)?,
        )
    }

    /// What tells one checkpoint from another of the same shape, cheaply: the tensor's dtype,
    /// shape and up to 256 stored bytes at each end.
    pub fn ends(&mut self, name: &str) -> Result<Ends> {
        let e = self
            .entries
            .get(name)
            .cloned()
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))?;
        let n = (e.end - e.begin).min(256);
        let head = self.bytes(e.begin, n as usize)?;
        let tail = self.bytes(e.end - n, n as usize)?;
        Ok((e.dtype, e.shape, head, tail))
    }
}

/// A checkpoint's files, each tensor found in exactly one.
pub struct Checkpoint {
    files: Vec<SafetensorsFile>,
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens the files (their headers only). A tensor in two files (a consolidated copy beside
    /// the shards, under the same names) is refused: which one a model got would depend on
    /// the order the files were read.
    pub fn open(paths: &[PathBuf], dir: &Path) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for p in paths {
            let f = SafetensorsFile::open(p)?;
            for name in f.names() {
                if index.insert(name.to_string(), files.len()).is_some() {
                    return Err(RuntimeError::Corrupt {
                        path: p.display().to_string(),
                        reason: format!(
                            "tensor {name} is in another .safetensors file of {} too",
                            dir.display()
                        ),
                    });
                }
            }
            files.push(f);
        }
        Ok(Self { files, index })
    }

    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn file(&mut self, name: &str) -> Result<&mut SafetensorsFile> {
        let i = *self
            .index
            .get(name)
            .ok_or_else(|| RuntimeError::MissingTensor(name.to_string()))?;
        Ok(&mut self.files[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("dspark-st-{}-{name}", std::process::id()))
    }

    #[test]
    fn reads_what_candle_wrote_whole_and_by_rows() {
        let p = tmp("rw.safetensors");
        let v: Vec<f32> = (0..6 * 5).map(|i| i as f32 * 0.25 - 3.0).collect();
        let base = Tensor::from_vec(v, (6, 5), &Device::Cpu).unwrap();
        let mut ts = HashMap::new();
        for (n, dt) in [
            ("f32", DType::F32),
            ("f16", DType::F16),
            ("bf16", DType::BF16),
        ] {
            ts.insert(n.to_string(), base.to_dtype(dt).unwrap());
        }
        ts.insert(
            "ints".to_string(),
            Tensor::new(&[1i64, 2, 3], &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&ts, &p).unwrap();
        let mut f = SafetensorsFile::open(&p).unwrap();
        for n in ["f32", "f16", "bf16"] {
            let want = ts[n].to_dtype(DType::F32).unwrap();
            let got = f.read(n).unwrap();
            assert_eq!(got.dims(), &[6, 5]);
            assert_eq!(
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{n}"
            );
            let rows = f.read_rows(n, 2, 5).unwrap();
            assert_eq!(
                rows.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.narrow(0, 2, 3)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                "{n} rows"
            );
        }
        assert_eq!(f.shape("ints"), Some(&[3usize][..]));
        let e = f.read("ints").unwrap_err();
        assert!(matches!(e, RuntimeError::UnsupportedQuant { .. }), "{e}");
        assert!(f.read_rows("f32", 4, 7).is_err());
        assert!(matches!(
            f.read("nope").unwrap_err(),
            RuntimeError::MissingTensor(_)
        ));
        let (dt, shape, head, tail) = f.ends("bf16").unwrap();
        assert_eq!((dt.as_str(), shape), ("BF16", vec![6, 5]));
        assert_eq!((head.len(), tail.len()), (60, 60));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn broken_headers_are_clear_errors() {
        let p = tmp("bad.safetensors");
        let write = |header: &str, data: usize| {
            let mut b = (header.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(header.as_bytes());
            b.extend(std::iter::repeat_n(0u8, data));
            std::fs::write(&p, b).unwrap();
        };
        let open = || SafetensorsFile::open(&p).err().map(|e| e.to_string());
        write(
            r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
            16,
        );
        assert_eq!(open(), None);
        for (header, data, why) in [
            (
                r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
                8,
                "outside the file",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}}"#,
                16,
                "in 16 bytes",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}}"#,
                16,
                "outside the file",
            ),
            (r#"{"a":{"dtype":"F32","shape":[2,2]}}"#, 16, "data_offsets"),
            (
                r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#,
                20,
                "tensors `a` and `b` share bytes 12..16",
            ),
            (r#"[1,2]"#, 0, "not a JSON object"),
            (r#"{"a":"#, 0, "not JSON"),
        ] {
            write(header, data);
            let e = open().unwrap_or_default();
            assert!(e.contains(why), "{header}: {e}");
        }
        // A header length past the file's end, and a file shorter than the length field.
        std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
        assert!(open().unwrap_or_default().contains("header of 1000 bytes"));
        std::fs::write(&p, [1u8, 2]).unwrap();
        assert!(open().unwrap_or_default().contains("shorter than"));
        let _ = std::fs::remove_file(&p);
    }
}
