void tierkv_bench_cuda_stub(void) {}
