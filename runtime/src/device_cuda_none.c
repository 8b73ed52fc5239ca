/* A runtime built with -DEDGEKV_CUDA=OFF (Android's default): a CUDA artifact is refused with how
 * to get a runtime that runs it. */
#include "device.h"

ekv_status ekv_device_cuda_open(ekv_error *err, const ekv_program *prog, const char *ptx_path, uint64_t plan_bytes,
                                ekv_device **out) {
  (void)prog;
  (void)ptx_path;
  (void)plan_bytes;
  *out = NULL;
  return ekv_fail(err, EKV_ERR_DEVICE, "this artifact runs on CUDA and this runtime was built without the CUDA device "
                  "(-DEDGEKV_CUDA=OFF): rebuild it with -DEDGEKV_CUDA=ON on Linux, or compile the artifact with "
                  "--target host");
}
