// ResNet's stem (a 7x7 stride-2 convolution with padding 3 over 3 channels) on tensor cores, as a convolution
// between tiled layouts, and the input layouts of the network. Host-only C++ (the CUDA kernel that converts the
// input uses InputLayout::source; tests/cpp/stem_test.cpp checks the whole mapping on the host against the 7x7).
//
// Why: cuDNN runs the 7x7 stride-2 stem over 3 channels on one slow engine; as a 3x3 stride-1 convolution between
// tiled layouts it runs on the fast ones (the measurements: docs/notes/handwritten-toward-the-limit.md).
// Tiled: input tile (a', b') holds, at pixel (u, v) of its 4x4, image pixel (4a' + u - kStemShift, 4b' + v -
// kStemShift) (48 channels); output tile (i, j) holds, at channel (dy * 2 + dx) * k + o, output pixel (2i + dy,
// 2j + dx)'s channel o (tiled_pixel). Output row 2i + dy reads image rows 4i + 2dy + y - 3 (y < 7), which input
// tile row i + a holds at u = y + 2 + 2dy - 4a: a 3x3 stride-1 convolution over the tiles, 4k wide.
#pragma once
#include <cstddef>
#include <vector>

#if defined(__CUDACC__)
#define RUNG_HOST_DEVICE __host__ __device__
#else
#define RUNG_HOST_DEVICE
#endif

namespace rung {

// The layout the contract's NCHW input is converted to (once, at build): `pad` zero pixels on each border, then
// each `block` x `block` tile of pixels folded into one pixel's channels (block 1: plain NHWC), channel
// (u * block + v) * c + i holding channel i of the tile's pixel (u, v); channels zero-padded to c_pad. The result
// is [n, out_h, out_w, c_pad]; pixels past the padded image are zero. Zero channels and pixels meet zero filter
// taps, so the convolution's result is unchanged.
struct InputLayout {
  int pad = 0, block = 1, out_h, out_w, c_pad;
  // Where channel ch of pixel (y, x) comes from in a c x h x w image (channel `from`, pixel (sy, sx)); false: a zero.
  RUNG_HOST_DEVICE bool source(int y, int x, int ch, int c, int h, int w, int& from, int& sy, int& sx) const {
    const int tap = ch / c;
    from = ch % c;
    sy = y * block + tap / block - pad;
    sx = x * block + tap % block - pad;
    return tap < block * block && sy >= 0 && sy < h && sx >= 0 && sx < w;
  }
};

constexpr int kStemShift = 5, kStemTaps = 3, kStemInputChannels = 4 * 4 * 3;

// The stem's output size for an image of `res` pixels; the tiled stem needs it even.
inline int stem_output(int res) { return (res + 2 * 3 - 7) / 2 + 1; }

inline InputLayout tiled_stem_input(int res) {
  const int tiles = stem_output(res) / 2 + kStemTaps - 1;
  return {kStemShift, 4, tiles, tiles, kStemInputChannels};
}

// Pixel (row, col) of image b of an activation stored in 2x2 pixel tiles: its index in units of c channels.
RUNG_HOST_DEVICE inline size_t tiled_pixel(size_t b, int row, int col, int tiles_h, int tiles_w) {
  return ((b * tiles_h + row / 2) * tiles_w + col / 2) * 4 + (row % 2) * 2 + col % 2;
}

// The 7x7 filter [k][7][7][c] (KRSC) as the tiled stem's [4k][3][3][c_pad]: tap (a, b) of input channel
// (u * 4 + v) * c + ch for output channel (dy * 2 + dx) * k + o is the 7x7 tap (4a + u - 2 - 2dy, 4b + v - 2 - 2dx),
// zero outside the 7x7 and in channels c_pad > 48.
inline std::vector<float> tiled_stem_filter(const std::vector<float>& w, int k, int c, int c_pad) {
  constexpr int r = 7;
  std::vector<float> out(size_t(4) * k * kStemTaps * kStemTaps * c_pad, 0.f);
  for (int tile = 0; tile < 4; ++tile)
    for (int o = 0; o < k; ++o)
      for (int a = 0; a < kStemTaps; ++a)
        for (int b = 0; b < kStemTaps; ++b)
          for (int u = 0; u < 4; ++u)
            for (int v = 0; v < 4; ++v) {
              const int y = 4 * a + u - 2 - 2 * (tile / 2), x = 4 * b + v - 2 - 2 * (tile % 2);
              if (y < 0 || y >= r || x < 0 || x >= r) continue;
              for (int ch = 0; ch < c; ++ch)
                out[(((size_t(tile) * k + o) * kStemTaps + a) * kStemTaps + b) * c_pad + (u * 4 + v) * c + ch] =
                    w[((size_t(o) * r + y) * r + x) * c + ch];
            }
  return out;
}

// The stem's bias [k] as the tiled stem's [4k]: each of the tile's four output pixels has the same bias.
inline std::vector<float> tiled_stem_bias(const std::vector<float>& b) {
  std::vector<float> out;
  for (int tile = 0; tile < 4; ++tile) out.insert(out.end(), b.begin(), b.end());
  return out;
}

}  // namespace rung
