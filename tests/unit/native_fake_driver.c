/* A stand-in for libcuda.so.1 (test_native_backward.py): the driver functions backward_node.cpp calls. Each launch
   appends a line to $FAKE_CUDA_LOG: the function, grid, threads, shared bytes, stream, then each parameter's first
   8 bytes in hex (14: the test kernels' 12 plus Triton's two scratch pointers). $FAKE_CUDA_CAPTURING=1 reports the
   stream as capturing. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static __thread void* current_context = 0; /* per thread, as the driver's */

void fake_make_current(void* context) { current_context = context; } /* the test's "forward thread" context */

int cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void* stream, void** params, void** extra) {
  FILE* log = fopen(getenv("FAKE_CUDA_LOG"), "a");
  fprintf(log, "%p %u %u %u %u %u %p %p", function, gx, gy, gz, bx, shared, stream, current_context);
  for (int i = 0; i < 14; ++i) fprintf(log, " %llx", (unsigned long long)*(uint64_t*)params[i]);
  fprintf(log, "\n");
  fclose(log);
  return 0;
}

int cuStreamIsCapturing(void* stream, int* status) {
  const char* capturing = getenv("FAKE_CUDA_CAPTURING");
  *status = capturing && capturing[0] == '1';
  return 0;
}

int cuGetErrorString(int error, const char** text) {
  *text = "fake driver";
  return 0;
}

int cuCtxGetCurrent(void** context) {
  *context = current_context;
  return 0;
}

int cuCtxSetCurrent(void* context) {
  current_context = context;
  return 0;
}
