// cpp/cudnn/src/stem.h on the host: the tiled stem (input through InputLayout::source, filter through
// tiled_stem_filter, output read back through tiled_pixel) computes the 7x7 stride-2 convolution with padding 3
// and its bias and ReLU, on random images of two sizes; and the plain NHWC layout is the image itself.
#include <cmath>
#include <cstdio>
#include <random>

#include "stem.h"

using rung::InputLayout;

namespace {

// img: [n][c][h][w] -> [n][out_h][out_w][c_pad] as the CUDA conversion does (kernels.cu nchw_to_nhwc_kernel).
std::vector<float> convert(const std::vector<float>& img, int n, int c, int h, int w, const InputLayout& to) {
  std::vector<float> out(size_t(n) * to.out_h * to.out_w * to.c_pad);
  for (int b = 0; b < n; ++b)
    for (int y = 0; y < to.out_h; ++y)
      for (int x = 0; x < to.out_w; ++x)
        for (int ch = 0; ch < to.c_pad; ++ch) {
          int from, sy, sx;
          const bool inside = to.source(y, x, ch, c, h, w, from, sy, sx);
          out[((size_t(b) * to.out_h + y) * to.out_w + x) * to.c_pad + ch] =
              inside ? img[((size_t(b) * c + from) * h + sy) * w + sx] : 0.f;
        }
  return out;
}

float relu(double v) { return v > 0 ? float(v) : 0.f; }

int check(int n, int res, int k, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const int c = 3, p = rung::stem_output(res);
  std::vector<float> img(size_t(n) * c * res * res), w(size_t(k) * 7 * 7 * c), bias(k);  // w: KRSC
  for (auto* v : {&img, &w, &bias})
    for (float& x : *v) x = normal(rng);

  // The reference: y[b][o][i][j] = relu(bias + sum over the 7x7 window, padding 3, stride 2), double sums.
  std::vector<float> ref(size_t(n) * k * p * p);
  for (int b = 0; b < n; ++b)
    for (int o = 0; o < k; ++o)
      for (int i = 0; i < p; ++i)
        for (int j = 0; j < p; ++j) {
          double s = bias[o];
          for (int r = 0; r < 7; ++r)
            for (int q = 0; q < 7; ++q) {
              const int y = 2 * i + r - 3, x = 2 * j + q - 3;
              if (y < 0 || y >= res || x < 0 || x >= res) continue;
              for (int ch = 0; ch < c; ++ch)
                s += double(w[((size_t(o) * 7 + r) * 7 + q) * c + ch]) * img[((size_t(b) * c + ch) * res + y) * res + x];
            }
          ref[((size_t(b) * k + o) * p + i) * p + j] = relu(s);
        }

  // Tiled: a 3x3 stride-1 convolution without padding over the 4x4-tiled input, 4k outputs per tile.
  const InputLayout in = rung::tiled_stem_input(res);
  const std::vector<float> z = convert(img, n, c, res, res, in);
  const std::vector<float> filter = rung::tiled_stem_filter(w, k, c, in.c_pad);
  const int tiles = p / 2, taps = rung::kStemTaps;
  double worst = 0, scale = 0;
  for (int b = 0; b < n; ++b)
    for (int ti = 0; ti < tiles; ++ti)
      for (int tj = 0; tj < tiles; ++tj)
        for (int oc = 0; oc < 4 * k; ++oc) {
          double s = bias[oc % k];
          for (int a = 0; a < taps; ++a)
            for (int e = 0; e < taps; ++e)
              for (int ch = 0; ch < in.c_pad; ++ch)
                s += double(filter[((size_t(oc) * taps + a) * taps + e) * in.c_pad + ch]) *
                     z[((size_t(b) * in.out_h + ti + a) * in.out_w + tj + e) * in.c_pad + ch];
          // Channel (dy * 2 + dx) * k + o of tile (ti, tj) is output pixel (2ti + dy, 2tj + dx)'s channel o: its
          // place in the tiled output, as the max-pool reads it, is tiled_pixel's.
          const int row = 2 * ti + oc / k / 2, col = 2 * tj + oc / k % 2, o = oc % k;
          const size_t at = rung::tiled_pixel(b, row, col, tiles, tiles) * k + o;
          if (at != ((size_t(b) * tiles + ti) * tiles + tj) * 4 * k + oc) {
            std::printf("tiled_pixel places output pixel (%d, %d) channel %d elsewhere\n", row, col, o);
            return 1;
          }
          const float want = ref[((size_t(b) * k + o) * p + row) * p + col];
          worst = std::fmax(worst, std::fabs(relu(s) - want));
          scale = std::fmax(scale, std::fabs(want));
        }
  if (worst > 1e-4 * scale) {
    std::printf("res %d: tiled stem off by %g (largest output %g)\n", res, worst, scale);
    return 1;
  }

  // The plain layout is the image in NHWC with zero channels.
  const std::vector<float> plain = convert(img, n, c, res, res, InputLayout{0, 1, res, res, 8});
  for (int ch = 0; ch < 8; ++ch) {
    const float got = plain[((size_t(1) * res + 2) * res + 5) * 8 + ch];
    const float want = ch < c ? img[((size_t(1) * c + ch) * res + 2) * res + 5] : 0.f;
    if (got != want) {
      std::printf("plain NHWC channel %d of pixel (2, 5): %g, not %g\n", ch, got, want);
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  for (int res : {32, 36})  // stem outputs 16 and 18 (the tiled stem needs an even one)
    if (check(2, res, 5, rng)) return 1;
  std::printf("ok stem\n");
  return 0;
}
