/* A runtime built without OpenCL headers: CPU artifacts only. An OpenCL artifact is refused with
 * how to get a runtime that runs it. */
#include "device.h"

const char *ekv_runtime_devices(void) { return "cpu" EKV_CUDA_DEVICE_NAME; }

ekv_status ekv_device_opencl_open(ekv_error *err, const ekv_program *prog, const char *source_path,
                                  uint64_t plan_bytes, ekv_device **out) {
  (void)prog;
  (void)source_path;
  (void)plan_bytes;
  *out = NULL;
  return ekv_fail(err, EKV_ERR_DEVICE, "this artifact runs on OpenCL and this runtime was built without OpenCL: install "
                  "the OpenCL headers (apt-get install opencl-c-headers) and rebuild it (pip install -e . or cmake), "
                  "or compile the artifact with --target host");
}
