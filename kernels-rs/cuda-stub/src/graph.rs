//! Graphs made by capture, their instantiation, launch (a graph's nodes run in capture order,
//! one launch of an executable graph after the previous one) and update.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUgraphExecUpdateResult as U;
use cudarc::driver::sys::CUresult as E;

use crate::context::{self, Context};
use crate::error::{CUresult, R, api, put, refuse};
use crate::handles::Registry;
use crate::stream::{self, Point, Submitted};
use crate::work::Work;

pub struct Graph {
    pub ctx: Arc<Context>,
    nodes: Vec<Work>,
}

impl Graph {
    pub fn new(ctx: Arc<Context>, nodes: Vec<Work>) -> Self {
        Self { ctx, nodes }
    }
}

pub struct Exec {
    ctx: Arc<Context>,
    nodes: Mutex<Arc<Vec<Work>>>,
    /// The previous launch: an executable graph runs one launch at a time.
    last: Mutex<Option<Point>>,
}

fn graphs() -> &'static Registry<Graph> {
    static G: OnceLock<Registry<Graph>> = OnceLock::new();
    G.get_or_init(Registry::default)
}

fn execs() -> &'static Registry<Exec> {
    static X: OnceLock<Registry<Exec>> = OnceLock::new();
    X.get_or_init(Registry::default)
}

pub fn register(g: Graph) -> *mut c_void {
    graphs().insert(Arc::new(g))
}

fn graph(h: *mut c_void) -> R<Arc<Graph>> {
    crate::initialized()?;
    graphs().get(h).ok_or(E::CUDA_ERROR_INVALID_VALUE)
}

fn exec(h: *mut c_void) -> R<Arc<Exec>> {
    crate::initialized()?;
    execs().get(h).ok_or(E::CUDA_ERROR_INVALID_VALUE)
}

/// `CUDA_GRAPH_INSTANTIATE_FLAG_*`: auto-free on launch, upload, device launch, node priority.
const AUTO_FREE: u64 = 1;
const DEVICE_LAUNCH: u64 = 4;
const FLAGS: u64 = 1 | 2 | 4 | 8;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphCreate(out: *mut *mut c_void, flags: u32) -> CUresult {
    api("cuGraphCreate", || {
        let ctx = context::current()?;
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, register(Graph::new(ctx, Vec::new()))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphDestroy(g: *mut c_void) -> CUresult {
    api("cuGraphDestroy", || {
        crate::initialized()?;
        graphs()
            .remove(g)
            .map(|_| ())
            .ok_or(E::CUDA_ERROR_INVALID_VALUE)
    })
}

/// The node count of a graph (`nodes` may be null); node handles are not modelled.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphGetNodes(
    g: *mut c_void,
    nodes: *mut *mut c_void,
    count: *mut usize,
) -> CUresult {
    api("cuGraphGetNodes", || {
        let g = graph(g)?;
        if !nodes.is_null() {
            return refuse(E::CUDA_ERROR_NOT_SUPPORTED, || {
                "cuGraphGetNodes with a node array: graph nodes are not modelled".into()
            });
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(count, g.nodes.len()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    out: *mut *mut c_void,
    g: *mut c_void,
    flags: u64,
) -> CUresult {
    api("cuGraphInstantiateWithFlags", || {
        let g = graph(g)?;
        if flags & !FLAGS != 0 || (flags & DEVICE_LAUNCH != 0 && flags & AUTO_FREE != 0) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        g.ctx.usable()?;
        let x = Arc::new(Exec {
            ctx: g.ctx.clone(),
            nodes: Mutex::new(Arc::new(g.nodes.clone())),
            last: Mutex::new(None),
        });
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, execs().insert(x)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphExecDestroy(x: *mut c_void) -> CUresult {
    api("cuGraphExecDestroy", || {
        crate::initialized()?;
        execs()
            .remove(x)
            .map(|_| ())
            .ok_or(E::CUDA_ERROR_INVALID_VALUE)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(x: *mut c_void, stream: *mut c_void) -> CUresult {
    api("cuGraphLaunch", || {
        let x = exec(x)?;
        let s = stream::resolve_for_work(stream)?;
        if s.ctx.id != x.ctx.id {
            return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
                "the graph was made in another context than the stream's".into()
            });
        }
        let nodes = x.nodes.lock().unwrap().clone();
        let mut last = x.last.lock().unwrap();
        let after = last.iter().cloned().collect();
        match stream::submit(&s, Work::Graph(nodes), after)? {
            Submitted::Queued(p) => *last = Some(p),
            Submitted::Captured => {}
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphUpload(x: *mut c_void, stream: *mut c_void) -> CUresult {
    api("cuGraphUpload", || {
        exec(x)?;
        stream::resolve_for_work(stream)?;
        Ok(())
    })
}

/// `CUgraphExecUpdateResultInfo`.
#[repr(C)]
pub struct UpdateInfo {
    result: U,
    error_node: *mut c_void,
    error_from_node: *mut c_void,
}

/// Why `new` cannot replace `old`'s parameters: the rules of instantiated-graph update (same
/// topology, node types, and for kernels the same context).
fn update_error(old: &[Work], new: &[Work]) -> Option<U> {
    if old.len() != new.len() {
        return Some(U::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED);
    }
    for (a, b) in old.iter().zip(new) {
        let same = match (a, b) {
            (Work::Launch(x), Work::Launch(y)) => {
                if x.context() != y.context() {
                    return Some(U::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE);
                }
                true
            }
            (Work::Copy { .. }, Work::Copy { .. })
            | (Work::Fill { .. }, Work::Fill { .. })
            | (Work::Host(_), Work::Host(_))
            | (Work::Nop, Work::Nop) => true,
            (Work::Graph(x), Work::Graph(y)) => return update_error(x, y),
            _ => false,
        };
        if !same {
            return Some(U::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED);
        }
    }
    None
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphExecUpdate_v2(
    x: *mut c_void,
    g: *mut c_void,
    info: *mut UpdateInfo,
) -> CUresult {
    api("cuGraphExecUpdate_v2", || {
        let x = exec(x)?;
        let g = graph(g)?;
        if info.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let mut nodes = x.nodes.lock().unwrap();
        let failed = update_error(&nodes, &g.nodes);
        // SAFETY: checked non-null.
        unsafe {
            put(
                info,
                UpdateInfo {
                    result: failed.unwrap_or(U::CU_GRAPH_EXEC_UPDATE_SUCCESS),
                    error_node: std::ptr::null_mut(),
                    error_from_node: std::ptr::null_mut(),
                },
            )?;
        }
        if let Some(why) = failed {
            return refuse(E::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, || {
                format!("{why:?}")
            });
        }
        // Launches already queued keep the nodes they were given.
        *nodes = Arc::new(g.nodes.clone());
        Ok(())
    })
}
