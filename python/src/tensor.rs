//! Tensors from Python through DLPack (dlpark): the dtype, the shape and, on the host,
//! the bytes, borrowed from the producer without a copy.
//!
//! The dtypes are SPEC 9's, as DLPack names them: `uint8`, `int8`, `float8_e4m3fn`,
//! `float8_e8m0fnu`, `float4_e2m1fn` (torch's `float4_e2m1fn_x2` arrives as two
//! 4-bit lanes a byte, a shape counted in bytes; one lane a value is a shape counted
//! in fp4 values, as safetensors' `F4`), `int32`, `int64`, `float32`, `bfloat16`.

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use dlpark::python::{from_dlpack, ImportedDlpack};
use dsa_indexer::Error;
use pyo3::prelude::*;

/// An element type the package accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dt {
    /// `uint8`: codes, packed fp4 or UE8M0 bytes.
    U8,
    /// `int8`: packed fp4.
    I8,
    /// `float8_e4m3fn`.
    F8E4m3,
    /// `float8_e8m0fnu`: UE8M0 scale bytes.
    F8E8m0,
    /// `float4_e2m1fn`, two values a byte, each element one byte (torch's `_x2`).
    F4x2,
    /// `float4_e2m1fn`, one value an element, two a byte (safetensors' `F4`).
    F4,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `float32`.
    F32,
    /// `bfloat16`.
    Bf16,
}

impl Dt {
    fn of(t: DLDataType) -> Option<Dt> {
        let c = t.code;
        Some(match (t.bits, t.lanes) {
            (8, 1) if c == DLDataTypeCode::UINT => Dt::U8,
            (8, 1) if c == DLDataTypeCode::INT => Dt::I8,
            (8, 1) if c == DLDataTypeCode::FLOAT8_E4M3FN => Dt::F8E4m3,
            (8, 1) if c == DLDataTypeCode::FLOAT8_E8M0FNU => Dt::F8E8m0,
            (4, 2) if c == DLDataTypeCode::FLOAT4_E2M1FN => Dt::F4x2,
            (4, 1) if c == DLDataTypeCode::FLOAT4_E2M1FN => Dt::F4,
            (32, 1) if c == DLDataTypeCode::INT => Dt::I32,
            (64, 1) if c == DLDataTypeCode::INT => Dt::I64,
            (32, 1) if c == DLDataTypeCode::FLOAT => Dt::F32,
            (16, 1) if c == DLDataTypeCode::BFLOAT => Dt::Bf16,
            _ => return None,
        })
    }

    /// The dtype's name as torch spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Dt::U8 => "uint8",
            Dt::I8 => "int8",
            Dt::F8E4m3 => "float8_e4m3fn",
            Dt::F8E8m0 => "float8_e8m0fnu",
            Dt::F4x2 => "float4_e2m1fn_x2",
            Dt::F4 => "float4_e2m1fn",
            Dt::I32 => "int32",
            Dt::I64 => "int64",
            Dt::F32 => "float32",
            Dt::Bf16 => "bfloat16",
        }
    }
}

/// A DLPack dtype in words: `float64`, `int16`, `float8 (code 11)`.
fn dl_name(t: DLDataType) -> String {
    let c = t.code;
    let kind = if c == DLDataTypeCode::INT {
        "int".to_string()
    } else if c == DLDataTypeCode::UINT {
        "uint".into()
    } else if c == DLDataTypeCode::FLOAT {
        "float".into()
    } else if c == DLDataTypeCode::BFLOAT {
        "bfloat".into()
    } else if c == DLDataTypeCode::BOOL {
        "bool".into()
    } else if c == DLDataTypeCode::COMPLEX {
        "complex".into()
    } else {
        format!("DLPack code {} of ", c.0)
    };
    let lanes = if t.lanes > 1 {
        format!(" x{}", t.lanes)
    } else {
        String::new()
    };
    format!("{kind}{}{lanes}", t.bits)
}

/// An input error naming the tensor: a ValueError with the crate's message.
pub fn bad(field: &str, problem: impl Into<String>) -> Error {
    Error::Dump {
        tensor: field.into(),
        problem: problem.into(),
    }
}

/// One imported tensor. It keeps the producer's buffer alive while it lives.
pub struct Tensor {
    /// The argument it was given as (`q`, `k_scale`, ...).
    pub name: &'static str,
    /// Element type.
    pub dtype: Dt,
    /// Shape in elements of `dtype`.
    pub shape: Vec<usize>,
    /// Where the data lives.
    pub device: DLDevice,
    dl: ImportedDlpack,
}

impl Tensor {
    /// Import `obj` (anything with `__dlpack__`) as argument `name`.
    pub fn import(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        Tensor::import_with(name, obj, None)
    }

    /// Import `obj` as argument `name` for work queued on the CUDA stream `stream`
    /// (the producer's current stream): no synchronisation is asked of the producer.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn import_on(
        name: &'static str,
        obj: &Bound<'_, PyAny>,
        stream: &CurrentStream,
    ) -> PyResult<Tensor> {
        Tensor::import_with(name, obj, Some(stream))
    }

    fn import_with(
        name: &'static str,
        obj: &Bound<'_, PyAny>,
        stream: Option<&dyn dlpark::python::DlpackStream>,
    ) -> PyResult<Tensor> {
        let dl = from_dlpack(obj.as_borrowed(), stream, None).map_err(|e| {
            crate::to_py(bad(
                name,
                format!("not a DLPack tensor ({e}): pass a numpy array or a torch tensor"),
            ))
        })?;
        let v = dl
            .validate()
            .map_err(|e| crate::to_py(bad(name, format!("DLPack: {e}"))))?;
        let dtype = Dt::of(v.dtype()).ok_or_else(|| {
            crate::to_py(bad(
                name,
                format!(
                    "dtype {}, expected one of SPEC 9's: uint8, int8, float8_e4m3fn, \
                     float8_e8m0fnu, float4_e2m1fn_x2, int32, int64, float32, bfloat16",
                    dl_name(v.dtype())
                ),
            ))
        })?;
        let shape = v
            .shape()
            .iter()
            .map(|&s| usize::try_from(s).unwrap_or(usize::MAX))
            .collect();
        let device = v.device();
        Ok(Tensor {
            name,
            dtype,
            shape,
            device,
            dl,
        })
    }

    /// `shape [..], dtype ..` for messages.
    pub fn describe(&self) -> String {
        format!("shape {:?}, dtype {}", self.shape, self.dtype.name())
    }

    /// An error naming this tensor: `q: shape [4, 8], dtype uint8, expected ...`.
    pub fn error(&self, expected: impl std::fmt::Display) -> Error {
        bad(
            self.name,
            format!("{}, expected {expected}", self.describe()),
        )
    }

    /// Whether the data lives in host memory.
    pub fn on_host(&self) -> bool {
        self.device.device_type == DLDeviceType::CPU
    }

    fn host(&self) -> dsa_indexer::Result<()> {
        if self.on_host() {
            Ok(())
        } else if self.device.device_type == DLDeviceType::CUDA {
            Err(bad(
                self.name,
                format!(
                    "{} on cuda:{} is converted on the host, which a device tensor is not: \
                     on CUDA pass the dtype the kernels read in place (float32 weights, int32 \
                     indices and page tables, UE8M0 bytes [.., D/32] for scales of D < 128)",
                    self.describe(),
                    self.device.device_id
                ),
            ))
        } else {
            Err(bad(
                self.name,
                format!(
                    "on DLPack device type {} (id {}), expected host memory",
                    self.device.device_type.0, self.device.device_id
                ),
            ))
        }
    }

    /// The tensor's bytes in host memory, row-major, borrowed.
    pub fn bytes(&self) -> dsa_indexer::Result<&[u8]> {
        let (ptr, bytes, _) = self.host_data()?;
        if bytes == 0 {
            return Ok(&[]);
        }
        // SAFETY: the producer keeps `bytes` initialised bytes behind the data pointer
        // while `self.dl` (the managed tensor) lives, and the slice borrows `self`.
        Ok(unsafe { std::slice::from_raw_parts(ptr, bytes) })
    }

    /// The tensor's elements as `T` (its dtype must be `T`'s), borrowed.
    pub fn slice<T: dlpark::DlpackElement>(&self) -> dsa_indexer::Result<&[T]> {
        let (ptr, _, elements) = self.host_data()?;
        let v = self.validated()?;
        if !v.dtype().is::<T>() {
            return Err(self.error(format!("{} elements", dl_name(T::DTYPE))));
        }
        if elements == 0 {
            return Ok(&[]);
        }
        if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(bad(
                self.name,
                format!("data at {ptr:p} is not aligned to its dtype"),
            ));
        }
        // SAFETY: as in `bytes`; the dtype is `T`'s and the pointer aligned to it.
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<T>(), elements) })
    }

    fn validated(&self) -> dsa_indexer::Result<dlpark::TensorRef<'_>> {
        self.dl
            .validate()
            .map_err(|e| bad(self.name, format!("DLPack: {e}")))
    }

    /// The host data pointer (byte offset applied), bytes and elements, once the
    /// layout is checked to be row-major. A dimension of size 1 may have any stride
    /// (numpy exports `a[:, None]` with stride 0), as DLPack allows.
    fn host_data(&self) -> dsa_indexer::Result<(*const u8, usize, usize)> {
        self.host()?;
        self.data()
    }

    /// The data pointer (byte offset applied), bytes and elements of a row-major
    /// tensor, wherever it lives.
    fn data(&self) -> dsa_indexer::Result<(*const u8, usize, usize)> {
        let v = self.validated()?;
        let strides = v
            .strides_or_compact()
            .map_err(|e| bad(self.name, format!("DLPack: {e}")))?;
        let mut want = 1i64;
        for (&n, &s) in v.shape().iter().zip(strides.iter()).rev() {
            if n != 1 && s != want {
                return Err(bad(
                    self.name,
                    format!(
                        "strides {strides:?} of shape {:?} are not row-major (pass a contiguous array)",
                        self.shape
                    ),
                ));
            }
            want = want.saturating_mul(n);
        }
        // SAFETY: the pointer is only offset (by DLPack's byte offset), not read.
        let ptr =
            unsafe { v.offset_bytes_ptr() }.map_err(|e| bad(self.name, format!("DLPack: {e}")))?;
        Ok((ptr, v.num_bytes(), v.num_elements()))
    }

    /// The device address and bytes of a row-major tensor in the memory of CUDA device
    /// `ordinal`; any other place is an error naming the tensor.
    #[cfg(feature = "cuda")]
    pub fn device_data(&self, ordinal: usize) -> dsa_indexer::Result<(u64, usize)> {
        let d = self.device;
        if d.device_type != DLDeviceType::CUDA || usize::try_from(d.device_id) != Ok(ordinal) {
            let place = if self.on_host() {
                "host memory".to_string()
            } else if d.device_type == DLDeviceType::CUDA {
                format!("cuda:{}", d.device_id)
            } else {
                format!(
                    "DLPack device type {} (id {})",
                    d.device_type.0, d.device_id
                )
            };
            return Err(bad(
                self.name,
                format!("in {place}, expected a CUDA tensor on cuda:{ordinal} (the device of q)"),
            ));
        }
        let (ptr, bytes, _) = self.data()?;
        Ok((ptr as u64, bytes))
    }

    /// Elements as `f32`: borrowed for `float32`, converted from `bfloat16`.
    pub fn floats(&self) -> dsa_indexer::Result<Floats<'_>> {
        match self.dtype {
            Dt::F32 => Ok(Floats::Borrowed(self.slice::<f32>()?)),
            Dt::Bf16 => {
                let b = self.bytes()?;
                Ok(Floats::Owned(
                    b.chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                ))
            }
            _ => Err(self.error("float32 or bfloat16")),
        }
    }

    /// Integer elements (`int32` or `int64`) as `i64`.
    pub fn ints(&self) -> dsa_indexer::Result<Vec<i64>> {
        match self.dtype {
            Dt::I32 => Ok(self.slice::<i32>()?.iter().map(|&x| x as i64).collect()),
            Dt::I64 => Ok(self.slice::<i64>()?.to_vec()),
            _ => Err(self.error("int32 or int64")),
        }
    }

    /// Integer elements as `i32`: borrowed for `int32`; `int64` converted, a value
    /// outside `i32` an error naming the entry.
    pub fn i32s(&self) -> dsa_indexer::Result<I32s<'_>> {
        match self.dtype {
            Dt::I32 => Ok(I32s::Borrowed(self.slice::<i32>()?)),
            Dt::I64 => self
                .slice::<i64>()?
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    i32::try_from(x).map_err(|_| Error::OutOfRange {
                        field: format!("{}[{i}]", self.name),
                        value: x.to_string(),
                        expected: "a value that fits int32",
                    })
                })
                .collect::<dsa_indexer::Result<Vec<i32>>>()
                .map(I32s::Owned),
            _ => Err(self.error("int32 or int64")),
        }
    }

    /// Non-negative integer elements as `usize`, a negative one an error naming the
    /// entry (`seq_lens[2] = -1`).
    pub fn counts(&self) -> dsa_indexer::Result<Vec<usize>> {
        if self.shape.len() != 1 {
            return Err(self.error("1 dimension"));
        }
        self.ints()?
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                usize::try_from(x).map_err(|_| Error::OutOfRange {
                    field: format!("{}[{i}]", self.name),
                    value: x.to_string(),
                    expected: "a value >= 0",
                })
            })
            .collect()
    }
}

/// `f32` elements, borrowed or converted.
pub enum Floats<'a> {
    /// The producer's `float32` buffer.
    Borrowed(&'a [f32]),
    /// Converted from `bfloat16`.
    Owned(Vec<f32>),
}

impl Floats<'_> {
    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        match self {
            Floats::Borrowed(s) => s,
            Floats::Owned(v) => v,
        }
    }
}

/// `i32` elements, borrowed or converted.
pub enum I32s<'a> {
    /// The producer's `int32` buffer.
    Borrowed(&'a [i32]),
    /// Converted from `int64`.
    Owned(Vec<i32>),
}

impl I32s<'_> {
    /// The values.
    pub fn as_slice(&self) -> &[i32] {
        match self {
            I32s::Borrowed(s) => s,
            I32s::Owned(v) => v,
        }
    }
}

/// The CUDA stream a call queues its work on, the producer's current stream, as a
/// DLPack consumer stream: the tensors are ready on it in stream order, so the producer
/// is asked for no synchronisation (`stream=-1`; host tensors get `None`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct CurrentStream(pub usize);

// SAFETY: `-1` and `None` name no stream; the raw handle is only compared.
unsafe impl dlpark::python::DlpackStream for CurrentStream {
    fn as_python_arg(
        &self,
        _py: Python<'_>,
        device: DLDevice,
    ) -> PyResult<dlpark::python::StreamArg> {
        Ok(if device.device_type == DLDeviceType::CUDA {
            dlpark::python::consumer::stream::no_sync()
        } else {
            dlpark::python::consumer::stream::none()
        })
    }

    unsafe fn wait_for_producer(
        &self,
        device: DLDevice,
        producer: *mut std::ffi::c_void,
    ) -> PyResult<bool> {
        // The producer's current stream is this one (or, on the host, none): nothing to
        // order. Otherwise decline, and the Python protocol is used.
        Ok(producer as usize == self.0 || device.device_type != DLDeviceType::CUDA)
    }
}
