#include "examples/data/fashion_mnist.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <memory>
#include <stdexcept>
#include <vector>

namespace tandem::examples {
namespace {

std::vector<uint8_t> read_gz(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), gzclose);
  if (!f) throw std::runtime_error("cannot open " + path + " (install dataset-fashion-mnist)");
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  for (;;) {
    const int n = gzread(f.get(), buf, sizeof buf);
    if (n < 0) throw std::runtime_error("cannot decompress " + path);
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
    if (out.size() > (256u << 20)) throw std::runtime_error(path + " is larger than any Fashion-MNIST file");
  }
  return out;
}

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | b[at + 3];
}

}  // namespace

Dataset load_fashion_mnist(const std::string& split, const std::string& dir) {
  const std::string images_path = dir + "/" + split + "-images-idx3-ubyte.gz";
  const std::string labels_path = dir + "/" + split + "-labels-idx1-ubyte.gz";
  const auto images = read_gz(images_path);
  const auto labels = read_gz(labels_path);
  if (images.size() < 16 || be32(images, 0) != 2051) throw std::runtime_error(images_path + ": not an IDX image file");
  if (labels.size() < 8 || be32(labels, 0) != 2049) throw std::runtime_error(labels_path + ": not an IDX label file");
  const int64_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (rows != 28 || cols != 28 || static_cast<int64_t>(be32(labels, 4)) != n) {
    throw std::runtime_error(split + ": image and label files disagree");
  }
  if (images.size() != static_cast<size_t>(16 + n * rows * cols) || labels.size() != static_cast<size_t>(8 + n)) {
    throw std::runtime_error(split + ": truncated file");
  }
  Dataset d;
  d.images = at::from_blob(const_cast<uint8_t*>(images.data()) + 16, {n, 1, rows, cols}, at::kByte)
                 .to(at::kFloat)
                 .div_(255.0)
                 .sub_(0.2860)
                 .div_(0.3530);
  d.labels = at::from_blob(const_cast<uint8_t*>(labels.data()) + 8, {n}, at::kByte).to(at::kLong);
  if (d.labels.max().item<int64_t>() > 9) throw std::runtime_error(labels_path + ": label out of range");
  return d;
}

}  // namespace tandem::examples
