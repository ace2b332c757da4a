/* The probe's per-step graph replay as one C call: is the stream capturing, and if not, launch.
 *
 * Through ctypes and torch's binding the same two driver calls cost the scheduler thread ~1.8 µs more
 * per step on an H200 host (argument conversion, the call frames, torch's stream lookup). The
 * driver's entry points are passed in as addresses, so this links nothing and never touches CUDA
 * itself; it keeps the GIL (a release would let another thread of the scheduler process take it in
 * the middle of the step). Built and loaded at run time by native.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*graph_launch_fn)(void *graph_exec, void *stream);           /* cuGraphLaunch */
typedef int (*stream_is_capturing_fn)(void *stream, int *capture_status); /* cuStreamIsCapturing */

/* replay(graph_launch, stream_is_capturing, graph_exec, stream) -> int
 *   0: launched; -1: the stream is capturing (nothing launched); > 0: the driver's error code. */
static PyObject *replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "replay(graph_launch, stream_is_capturing, graph_exec, stream)");
        return NULL;
    }
    void *ptrs[4];
    for (Py_ssize_t i = 0; i < 4; i++) {
        ptrs[i] = PyLong_AsVoidPtr(args[i]);
        if (ptrs[i] == NULL && PyErr_Occurred()) return NULL;
    }
    if (ptrs[0] == NULL || ptrs[1] == NULL) {
        PyErr_SetString(PyExc_ValueError, "replay: a driver entry point is NULL");
        return NULL;
    }
    int status = 0;
    int err = ((stream_is_capturing_fn)ptrs[1])(ptrs[3], &status);
    if (err != 0) return PyLong_FromLong(err);
    if (status != 0) return PyLong_FromLong(-1); /* active or invalidated capture */
    return PyLong_FromLong(((graph_launch_fn)ptrs[0])(ptrs[2], ptrs[3]));
}

static PyMethodDef methods[] = {
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL,
     "replay(graph_launch, stream_is_capturing, graph_exec, stream) -> 0 launched, -1 capturing, "
     "> 0 driver error"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hs_tracer_graph_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hs_tracer_graph_replay(void) { return PyModule_Create(&module); }
