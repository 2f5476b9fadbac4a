// Gather / scatter of a request's fragmented pages, one CUDA block per piece.
//
// kvxfer's staging (kvxfer/staging/cuda.py) packs the planned extents of a window into a contiguous device
// buffer before one DMA copy to pinned host memory, and unpacks after one DMA copy back; one launch replaces a
// cudaMemcpyAsync per page. The host splits pieces to at most 64 KiB so blocks are evenly loaded; a piece whose
// addresses and length are 16-byte aligned moves in 16-byte vectors, any other piece byte by byte.
// Compiled at run time through NVRTC (cupy.RawModule); nothing to build on machines without CUDA.

extern "C" __global__ void kvx_copy_pieces(const unsigned long long *src, const unsigned long long *dst,
                                           const unsigned long long *len, long long pieces) {
    const long long p = blockIdx.x;
    if (p >= pieces) return;
    const unsigned long long s = src[p], d = dst[p], n = len[p];
    if (((s | d | n) & 15ULL) == 0) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(s);
        uint4 *d4 = reinterpret_cast<uint4 *>(d);
        for (unsigned long long i = threadIdx.x; i < (n >> 4); i += blockDim.x) d4[i] = s4[i];
    } else {
        const unsigned char *s1 = reinterpret_cast<const unsigned char *>(s);
        unsigned char *d1 = reinterpret_cast<unsigned char *>(d);
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d1[i] = s1[i];
    }
}
