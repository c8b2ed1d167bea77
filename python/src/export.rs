//! Outputs to Python through DLPack: an owned host array behind a small object with
//! `__dlpack__` and `__dlpack_device__`, which `numpy.from_dlpack` (or
//! `torch.from_dlpack`) adopts without a copy.

use std::sync::Arc;

use dlpark::allocation::dynamic;
use dlpark::ffi::{DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackElement, DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

/// Row-major elements and their shape.
pub(crate) struct Owned<T> {
    data: Vec<T>,
    shape: Vec<usize>,
}

/// The element types the package returns.
pub(crate) enum Data {
    I32(Arc<Owned<i32>>),
    F32(Arc<Owned<f32>>),
    U8(Arc<Owned<u8>>),
}

/// A host array handed to Python. Every `__dlpack__` call makes a fresh managed
/// tensor that shares the buffer (an `Arc`), so the object can be exported again.
#[pyclass(module = "dsa_indexer._native", frozen)]
pub struct Array {
    data: Data,
}

/// An array of `T` with `shape` (row-major `data`).
pub(crate) trait Element: DlpackElement + Send + Sync + Copy {
    #[doc(hidden)]
    fn wrap(o: Owned<Self>) -> Data;
}
impl Element for i32 {
    fn wrap(o: Owned<i32>) -> Data {
        Data::I32(Arc::new(o))
    }
}
impl Element for f32 {
    fn wrap(o: Owned<f32>) -> Data {
        Data::F32(Arc::new(o))
    }
}
impl Element for u8 {
    fn wrap(o: Owned<u8>) -> Data {
        Data::U8(Arc::new(o))
    }
}

impl Array {
    /// `data` (row-major, `shape.product()` elements) as an exportable array.
    pub(crate) fn new<T: Element>(data: Vec<T>, shape: &[usize]) -> Array {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>());
        Array {
            data: T::wrap(Owned {
                data,
                shape: shape.to_vec(),
            }),
        }
    }

    /// An ndarray, copied into row-major order only if it is not already.
    pub(crate) fn from_nd<T: Element, D: ndarray::Dimension>(a: ndarray::Array<T, D>) -> Array {
        let shape = a.shape().to_vec();
        let data = if a.is_standard_layout() {
            a.into_raw_vec_and_offset().0
        } else {
            a.iter().copied().collect()
        };
        Array::new(data, &shape)
    }
}

fn managed<T: Element, M: ManagedTensorBase>(o: &Arc<Owned<T>>) -> PyResult<Managed<M>> {
    let mut init: dynamic::Initialized<M> = Dynamic::compact(o.shape.clone())
        .initialize_as::<M>(Arc::clone(o))
        .map_err(|e| PyBufferError::new_err(e.to_string()))?;
    let ptr = if o.data.is_empty() {
        std::ptr::null_mut()
    } else {
        o.data.as_ptr() as *mut std::ffi::c_void
    };
    init.set_data(ptr);
    init.set_dtype(T::DTYPE);
    init.set_device(DLDevice::CPU);
    // SAFETY: the data pointer and shape describe `o.data`, compact row-major; the
    // managed tensor holds a clone of the `Arc`, so the buffer outlives it, and the
    // buffer is never written after construction (no flags: a consumer may write,
    // as numpy's own exports allow; each `Array` is handed to one consumer).
    Ok(unsafe { init.finish() })
}

impl DlpackExporter for Array {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        match &self.data {
            Data::I32(o) => managed(o),
            Data::F32(o) => managed(o),
            Data::U8(o) => managed(o),
        }
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        match &self.data {
            Data::I32(o) => managed(o),
            Data::F32(o) => managed(o),
            Data::U8(o) => managed(o),
        }
    }
}

#[pymethods]
impl Array {
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDevice::CPU.device_type.0, DLDevice::CPU.device_id)
    }
}
