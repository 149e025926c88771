#include "tandem/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <set>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tandem/comm/process_group.h"
#include "tandem/ddp/sampler.h"
#include "tandem/ddp/zero.h"
#include "tandem/fsdp/fsdp.h"
#include "tandem/log/log.h"
#include "tandem/rpc/errors.h"

namespace tandem::checkpoint {

// ---- items

struct State::Item {
  std::string name;
  State::Save save;
  State::Load load;
};

namespace {

bool valid_name(const std::string& name) {
  if (name.empty()) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; });
}

std::string describe(const at::Tensor& t) { return c10::str(t.sizes(), " ", t.scalar_type()); }  // [2, 3] Float

// `saved` into `target` in place, when both have the same shape and dtype.
void copy_checked(const std::string& what, const at::Tensor& saved, at::Tensor& target) {
  if (saved.sizes() != target.sizes() || saved.scalar_type() != target.scalar_type()) {
    throw_error(absl::InvalidArgumentError(
        absl::StrCat("'", what, "' is ", describe(saved), " in the checkpoint but ", describe(target), " here")));
  }
  torch::NoGradGuard no_grad;
  target.copy_(saved);
}

// A module's parameters and buffers by their qualified names ("fc1.weight"): two lists, as archive keys may not hold
// dots.
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// Named tensors as two lists, as archive keys may not hold every character a name does.
void save_named(const Named& named, torch::serialize::OutputArchive& archive) {
  c10::List<std::string> names;
  c10::List<at::Tensor> tensors;
  for (const auto& [name, t] : named) {
    names.push_back(name);
    tensors.push_back(t.detach());
  }
  archive.write("names", c10::IValue(names));
  archive.write("tensors", c10::IValue(tensors));
}

Named read_named(const std::string& item, torch::serialize::InputArchive& archive) {
  c10::IValue names_value, tensors_value;
  archive.read("names", names_value);
  archive.read("tensors", tensors_value);
  if (!names_value.isList() || !tensors_value.isTensorList()) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, "' is not named tensors in the checkpoint")));
  }
  const auto names = names_value.toListRef();
  const auto tensors = tensors_value.toTensorList();
  if (names.size() != tensors.size()) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, "': malformed named tensors in the checkpoint")));
  }
  Named out;
  for (size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i].toStringRef(), tensors.get(i));
  return out;
}

// A module's parameters and buffers by their qualified names ("fc1.weight"; a buffer's prefixed "buffer:").
constexpr const char* kBuffer = "buffer:";
void save_module(torch::nn::Module& module, torch::serialize::OutputArchive& archive) {
  Named named;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) named.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) named.emplace_back(kBuffer + b.key(), b.value());
  save_named(named, archive);
}

void load_module(const std::string& item, torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  std::map<std::string, at::Tensor> saved;
  for (auto& [name, t] : read_named(item, archive)) saved[name] = t;
  auto restore = [&](const std::string& key, at::Tensor target) {
    auto it = saved.find(key);
    if (it == saved.end()) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, ".", key, "' is not in the checkpoint")));
    }
    copy_checked(item + "." + key, it->second, target);
    saved.erase(it);
  };
  for (auto& p : module.named_parameters(true)) restore(p.key(), p.value());
  for (auto& b : module.named_buffers(true)) restore(kBuffer + b.key(), b.value());
  if (!saved.empty()) {
    throw_error(absl::InvalidArgumentError(
        absl::StrCat("the checkpoint's '", item, "' has '", saved.begin()->first, "', which the module does not")));
  }
}

// A fully sharded model's full state, in the module format.
void save_fsdp_full(const fsdp::FullyShardedDataParallel& model, torch::serialize::OutputArchive& archive) {
  Named named = model.full_parameters();
  for (const auto& b : model.named_buffers()) named.emplace_back(kBuffer + b.first, b.second);
  save_named(named, archive);
}
void load_fsdp_full(const std::string& item, fsdp::FullyShardedDataParallel& model,
                    torch::serialize::InputArchive& archive) {
  Named dict = read_named(item, archive);
  for (auto& [name, t] : dict) {
    if (absl::StartsWith(name, kBuffer)) name = name.substr(std::strlen(kBuffer));
  }
  model.load_full_state_dict(dict);
}

// A fully sharded model's sharded state: this rank's pieces, with their offsets and the parameters' shapes.
void save_fsdp_sharded(const fsdp::FullyShardedDataParallel& model, torch::serialize::OutputArchive& archive) {
  const auto dict = model.sharded_state_dict();
  archive.write("world_size", at::tensor(dict.world_size), /*is_buffer=*/true);
  archive.write("rank", at::tensor(dict.rank), /*is_buffer=*/true);
  c10::List<std::string> names;
  c10::List<at::Tensor> shapes, values;
  std::vector<int64_t> offsets;
  for (const auto& p : dict.pieces) {
    names.push_back(p.name);
    shapes.push_back(at::tensor(p.shape, at::kLong));
    offsets.push_back(p.offset);
    values.push_back(p.values);
  }
  archive.write("names", c10::IValue(names));
  archive.write("shapes", c10::IValue(shapes));
  archive.write("offsets", at::tensor(offsets, at::kLong), /*is_buffer=*/true);
  archive.write("values", c10::IValue(values));
  torch::serialize::OutputArchive buffers;
  save_named(dict.buffers, buffers);
  archive.write("buffers", buffers);
}
fsdp::FullyShardedDataParallel::ShardedStateDict read_fsdp_sharded(const std::string& item,
                                                                   torch::serialize::InputArchive& archive) {
  fsdp::FullyShardedDataParallel::ShardedStateDict dict;
  at::Tensor world, rank, offsets;
  archive.read("world_size", world, /*is_buffer=*/true);
  archive.read("rank", rank, /*is_buffer=*/true);
  archive.read("offsets", offsets, /*is_buffer=*/true);
  c10::IValue names_value, shapes_value, values_value;
  archive.read("names", names_value);
  archive.read("shapes", shapes_value);
  archive.read("values", values_value);
  const bool lists = names_value.isList() && shapes_value.isTensorList() && values_value.isTensorList();
  if (!lists || world.numel() != 1 || rank.numel() != 1 || offsets.dim() != 1 || offsets.scalar_type() != at::kLong) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, "' is not a fully sharded model's state")));
  }
  const auto names = names_value.toListRef();
  const auto shapes = shapes_value.toTensorList();
  const auto values = values_value.toTensorList();
  if (shapes.size() != names.size() || values.size() != names.size() ||
      offsets.numel() != static_cast<int64_t>(names.size())) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, "': malformed fully sharded state")));
  }
  dict.world_size = world.item<int64_t>();
  dict.rank = rank.item<int64_t>();
  for (size_t i = 0; i < names.size(); ++i) {
    const at::Tensor shape = shapes.get(i).to(at::kLong).contiguous();
    dict.pieces.push_back({names[i].toStringRef(),
                           std::vector<int64_t>(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + shape.numel()),
                           offsets[static_cast<int64_t>(i)].item<int64_t>(), values.get(i)});
  }
  torch::serialize::InputArchive buffers;
  archive.read("buffers", buffers);
  dict.buffers = read_named(item, buffers);
  return dict;
}

// Runs a LibTorch load, whose checks throw c10::Error, as tandem::Error naming the item.
void guarded(const std::string& item, const std::function<void()>& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw_error(absl::InvalidArgumentError(absl::StrCat("'", item, "' does not fit its checkpoint: ", e.what())));
  }
}

}  // namespace

State::State() = default;
State::~State() = default;
State::State(State&&) noexcept = default;
State& State::operator=(State&&) noexcept = default;

State& State::add(const std::string& name, Save save, Load load) {
  if (!valid_name(name)) {
    throw_error(absl::InvalidArgumentError(
        absl::StrCat("checkpoint item name '", name, "': use letters, digits, '_' and '-'")));
  }
  for (const auto& item : items_) {
    if (item->name == name) throw_error(absl::InvalidArgumentError(absl::StrCat("checkpoint item '", name, "' twice")));
  }
  items_.push_back(std::make_unique<Item>(Item{name, std::move(save), std::move(load)}));
  return *this;
}

State& State::add(const std::string& name, torch::nn::Module& module) {
  return add(
      name, [&module](torch::serialize::OutputArchive& a) { save_module(module, a); },
      [&module, name](torch::serialize::InputArchive& a) { load_module(name, module, a); });
}

State& State::add(const std::string& name, torch::optim::Optimizer& optimizer) {
  return add(
      name, [&optimizer](torch::serialize::OutputArchive& a) { optimizer.save(a); },
      [&optimizer](torch::serialize::InputArchive& a) { optimizer.load(a); });
}

State& State::add(const std::string& name, ddp::ZeroRedundancyOptimizer& zero, Zero how) {
  if (how == Zero::kConsolidated) {
    return add(
        name, [&zero](torch::serialize::OutputArchive& a) { zero.save_consolidated(a); },
        [&zero](torch::serialize::InputArchive& a) { zero.load_consolidated(a); });
  }
  return add(
      name, [&zero](torch::serialize::OutputArchive& a) { zero.save(a); },
      [&zero](torch::serialize::InputArchive& a) { zero.load(a); });
}

State& State::add(const std::string& name, fsdp::FullyShardedDataParallel& model, Fsdp how) {
  if (how == Fsdp::kFull) {
    return add(
        name, [&model](torch::serialize::OutputArchive& a) { save_fsdp_full(model, a); },
        [&model, name](torch::serialize::InputArchive& a) { load_fsdp_full(name, model, a); });
  }
  return add(
      name, [&model](torch::serialize::OutputArchive& a) { save_fsdp_sharded(model, a); },
      [&model, name](torch::serialize::InputArchive& a) { model.load_sharded_state_dict(read_fsdp_sharded(name, a)); });
}

State& State::add(const std::string& name, torch::optim::Optimizer& optimizer, fsdp::FullyShardedDataParallel& model) {
  return add(
      name,
      [&optimizer, &model](torch::serialize::OutputArchive& a) {
        save_named(model.full_optimizer_state_dict(optimizer), a);
      },
      [&optimizer, &model, name](torch::serialize::InputArchive& a) {
        model.load_full_optimizer_state_dict(optimizer, read_named(name, a));
      });
}

State& State::add(const std::string& name, ddp::DistributedSampler& sampler) {
  return add(
      name, [&sampler](torch::serialize::OutputArchive& a) { sampler.save(a); },
      [&sampler](torch::serialize::InputArchive& a) { sampler.load(a); });
}

State& State::add(const std::string& name, at::Tensor& tensor) {
  return add(
      name, [&tensor](torch::serialize::OutputArchive& a) { a.write("value", tensor.detach(), /*is_buffer=*/true); },
      [&tensor, name](torch::serialize::InputArchive& a) {
        at::Tensor saved;
        a.read("value", saved, /*is_buffer=*/true);
        if (tensor.defined()) {
          copy_checked(name, saved, tensor);
        } else {
          tensor = saved;
        }
      });
}

State& State::add(const std::string& name, int64_t& counter) {
  return add(
      name, [&counter](torch::serialize::OutputArchive& a) { a.write("value", at::tensor(counter), true); },
      [&counter, name](torch::serialize::InputArchive& a) {
        at::Tensor saved;
        a.read("value", saved, true);
        if (saved.numel() != 1 || saved.scalar_type() != at::kLong) {
          throw_error(absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a counter in the checkpoint")));
        }
        counter = saved.item<int64_t>();
      });
}

// ---- files
//
// A file: "TDMCKPT1" (8 bytes), the payload's length (8 bytes, little-endian), its CRC-32 (4 bytes), the payload (a
// LibTorch archive, as OutputArchive::save_to writes it).

namespace {

constexpr char kMagic[8] = {'T', 'D', 'M', 'C', 'K', 'P', 'T', '1'};
constexpr size_t kHeader = 8 + 8 + 4;

absl::Status io_error(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat("checkpoint: ", what, " ", path, ": ", std::strerror(errno)));
}

uint32_t crc_of(const std::string& data) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {  // zlib takes uInt lengths
    const uInt n = static_cast<uInt>(std::min<size_t>(left, std::numeric_limits<uInt>::max()));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p), n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

void put_le(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) throw_error(io_error("cannot open directory", dir));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw_error(io_error("cannot flush directory", dir));
}

void make_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) throw_error(io_error("cannot make directory", dir));
}

// Writes `header + payload` to `path` atomically (aside, flushed, renamed, directory flushed).
void write_atomically(const std::string& dir, const std::string& path, const std::string& header,
                      const std::string& payload, bool sync) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_error(io_error("cannot create", tmp));
  auto write_all = [&](const std::string& data) {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  };
  const bool written = write_all(header) && write_all(payload) && (!sync || ::fsync(fd) == 0);
  absl::Status failed = written ? absl::OkStatus() : io_error("cannot write", tmp);
  // close() may report a write the kernel deferred (NFS, a quota): the file is not renamed into place then.
  if (::close(fd) != 0 && failed.ok()) failed = io_error("cannot write (close)", tmp);
  if (!failed.ok()) {
    ::unlink(tmp.c_str());
    throw_error(failed);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = io_error("cannot rename into", path);
    ::unlink(tmp.c_str());
    throw_error(s);
  }
  if (sync) sync_dir(dir);
}

// The payload of an intact file; DATA_LOSS naming what is wrong otherwise (NOT_FOUND-like absence is DATA_LOSS too:
// for a restore, a missing part is as lost as a torn one).
absl::StatusOr<std::string> read_payload(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // A file that is not there is a step this rank lacks; one it cannot open (permissions, no descriptors left) is not
    // a damaged step to pass over.
    if (errno == ENOENT) return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", std::strerror(errno)));
    return io_error("cannot open", path);
  }
  std::string data;
  char buf[1 << 16];
  try {
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const absl::Status s = io_error("cannot read", path);
        ::close(fd);
        return s;
      }
      if (n == 0) break;
      data.append(buf, static_cast<size_t>(n));
    }
  } catch (const std::bad_alloc&) {
    // A file larger than this process can hold is not a damaged step to pass over either (restore fails on every rank).
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("checkpoint ", path, ": out of memory reading it (", data.size(), " bytes read)"));
  }
  ::close(fd);
  if (data.size() < kHeader || std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is not a Tandem checkpoint, or is torn"));
  }
  const uint64_t length = get_le(data.data() + 8, 8);
  const uint32_t crc = static_cast<uint32_t>(get_le(data.data() + 16, 4));
  if (length != data.size() - kHeader) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, " is torn: ", data.size() - kHeader, " of ", length, " bytes"));
  }
  data.erase(0, kHeader);  // in place: a second copy of a large file could fail where the first did not
  if (crc_of(data) != crc) return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged (CRC)"));
  return data;
}

}  // namespace

Checkpointer::Checkpointer(std::string dir, int rank, CheckpointOptions options)
    : dir_(std::move(dir)), rank_(rank), options_(options) {
  if (rank_ < 0) throw_error(absl::InvalidArgumentError("Checkpointer: a negative rank"));
  if (options_.keep < 2) throw_error(absl::InvalidArgumentError("Checkpointer: keep must be at least 2"));
  make_dir(dir_);
}

std::string Checkpointer::path(int64_t step) const { return path_of(step, rank_); }

std::string Checkpointer::path_of(int64_t step, int rank) const {
  return absl::StrFormat("%s/step-%012d/rank-%d.ckpt", dir_, step, rank);
}

void Checkpointer::save(int64_t step, const State& state) {
  if (step < 0) throw_error(absl::InvalidArgumentError("Checkpointer::save: a negative step"));
  torch::serialize::OutputArchive archive;
  archive.write("step", at::tensor(step), /*is_buffer=*/true);
  for (const auto& item : state.items_) {
    torch::serialize::OutputArchive sub;
    item->save(sub);
    archive.write("item_" + item->name, sub);  // prefixed: no item can take the archive's own keys
  }
  std::string payload;
  archive.save_to([&payload](const void* data, size_t n) {
    payload.append(static_cast<const char*>(data), n);
    return n;
  });
  std::string header(kMagic, sizeof(kMagic));
  put_le(&header, payload.size(), 8);
  put_le(&header, crc_of(payload), 4);
  const std::string step_dir = absl::StrFormat("%s/step-%012d", dir_, step);
  // Another rank may remove the step's directory between our mkdir and our create, when it is far enough ahead for
  // this step to be old to it (its prune): the directory is made again.
  for (int attempt = 1;; ++attempt) {
    make_dir(step_dir);
    if (options_.sync) sync_dir(dir_);
    try {
      write_atomically(step_dir, path(step), header, payload, options_.sync);
      break;
    } catch (const Error&) {
      struct stat st;
      if (attempt == 3 || ::stat(step_dir.c_str(), &st) == 0) throw;
    }
  }
  prune(step);
}

std::vector<int64_t> Checkpointer::steps() const { return steps_of(rank_); }

std::vector<int64_t> Checkpointer::steps_of(int rank) const {
  std::vector<int64_t> out;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) {
    if (errno == ENOENT) return out;  // no checkpoint yet
    throw_error(io_error("cannot list", dir_));
  }
  const std::string mine = absl::StrCat("rank-", rank, ".ckpt");
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    int64_t step = 0;
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    struct stat st;
    const std::string file = absl::StrCat(dir_, "/", name, "/", mine);
    if (::stat(file.c_str(), &st) == 0) {
      out.push_back(step);
    } else if (errno != ENOENT && errno != ENOTDIR) {
      const absl::Status why = io_error("cannot read", file);  // errno before closedir
      ::closedir(d);
      throw_error(why);  // a step this rank may have but cannot see (permissions, an I/O error) is not passed over
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

void Checkpointer::prune(int64_t saved) const {
  // The newest `keep` steps up to the one just saved: steps above it are another run's (a job started afresh in a
  // directory with newer steps; restore() refuses to start afresh beside them) and must not make this run's saves go
  // as soon as they are written.
  std::vector<int64_t> all = steps();
  const auto above = std::upper_bound(all.begin(), all.end(), saved);
  if (above != all.end() && !warned_newer_) {
    warned_newer_ = true;
    TANDEM_LOG(kWarn, "checkpoint") << dir_ << " holds steps above step " << saved << " (up to " << all.back()
                                    << ") of another run: they stay, and restore() would resume from them, not from "
                                       "this run's";
  }
  all.erase(above, all.end());
  const std::set<int64_t> kept(all.end() - std::min<size_t>(all.size(), options_.keep), all.end());
  // Pruning failures are logged (once a run): old steps that cannot go would pile up unseen until a save fails for
  // want of space.
  auto failed = [this](const std::string& what, const std::string& path) {
    const int e = errno;  // before the log's own calls
    if (warned_prune_) return;
    warned_prune_ = true;
    TANDEM_LOG(kWarn, "checkpoint") << "cannot " << what << " " << path << " (pruning old steps): " << std::strerror(e)
                                    << "; further failures of this pruning are not logged";
  };
  DIR* d = ::opendir(dir_.c_str());
  if (!d) return failed("list", dir_);
  std::vector<std::string> step_dirs;
  while (dirent* e = ::readdir(d)) {
    if (absl::StartsWith(e->d_name, "step-")) step_dirs.push_back(e->d_name);
  }
  ::closedir(d);
  const std::string mine = absl::StrCat("rank-", rank_, ".ckpt");
  for (const std::string& name : step_dirs) {
    const std::string step_dir = absl::StrCat(dir_, "/", name);
    int64_t step = 0;
    const bool is_step = absl::SimpleAtoi(name.substr(5), &step);
    // This rank's leftovers of writes that were cut (a crash between create and rename): nobody else writes them.
    if (DIR* sd = ::opendir(step_dir.c_str())) {
      std::vector<std::string> stale;
      while (dirent* e = ::readdir(sd)) {
        if (absl::StartsWith(e->d_name, mine + ".tmp.")) stale.push_back(e->d_name);
      }
      ::closedir(sd);
      for (const auto& f : stale) {
        const std::string path = absl::StrCat(step_dir, "/", f);
        if (::unlink(path.c_str()) != 0 && errno != ENOENT) failed("remove", path);
      }
    }
    // Only steps older than this rank's oldest kept one: a newer directory may be another rank's save in progress.
    if (is_step && !kept.empty() && step < *kept.begin()) {
      const std::string path = absl::StrCat(step_dir, "/", mine);
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) failed("remove", path);
      // Fails while other ranks' files are there (ENOTEMPTY, or EEXIST); the last one removes it.
      if (::rmdir(step_dir.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT) {
        failed("remove", step_dir);
      }
    }
  }
}

void Checkpointer::load(int64_t step, State& state) {
  auto payload = read_payload(path(step));
  throw_if_error(payload.status());
  load_payload(path(step), *payload, state);
}

void Checkpointer::load_payload(const std::string& file, const std::string& payload, State& state) {
  torch::serialize::InputArchive archive;
  guarded("the checkpoint", [&] { archive.load_from(payload.data(), payload.size()); });
  for (const auto& item : state.items_) {
    torch::serialize::InputArchive sub;
    if (!archive.try_read("item_" + item->name, sub)) {
      throw_error(absl::InvalidArgumentError(absl::StrCat("'", item->name, "' is not in checkpoint ", file)));
    }
    try {
      guarded(item->name, [&] { item->load(sub); });
    } catch (const Error& e) {
      throw_error(absl::Status(e.code(), absl::StrCat(e.status().message(), " (", file, ")")));
    }
  }
}

absl::StatusOr<std::optional<std::pair<int64_t, std::string>>> Checkpointer::newest_intact_at_most(int64_t bound,
                                                                                                   int rank) const {
  std::vector<int64_t> all;
  try {
    all = steps_of(rank);
  } catch (...) {
    return status_from_current_exception();
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (*it > bound) continue;
    auto payload = read_payload(path_of(*it, rank));
    if (payload.ok()) return std::make_optional(std::make_pair(*it, std::move(*payload)));
    // A torn or damaged file is passed over for an older step (said here); any other failure to read one is an error.
    if (!absl::IsDataLoss(payload.status())) return payload.status();
    TANDEM_LOG(kWarn, "checkpoint") << "passing over step " << *it << ": " << payload.status().message();
  }
  return std::optional<std::pair<int64_t, std::string>>();
}

std::optional<int64_t> Checkpointer::restore(State& state, comm::ProcessGroup* group, Layout layout) {
  const int source = layout == Layout::kReplicated ? 0 : rank_;  // whose files this rank reads
  // Each round, the ranks agree on the smallest of their newest intact steps; if one of them lacks that step intact
  // (it kept other ones), they look again below it. Every round lowers the bound, so this ends.
  // Every rank's value `v`, by group rank (this rank's alone without a group).
  auto each_rank = [group](int64_t v) {
    if (!group) return std::vector<int64_t>{v};
    at::Tensor t = at::full({group->size()}, std::numeric_limits<int64_t>::min(), at::kLong);
    t.data_ptr<int64_t>()[group->rank()] = v;
    comm::wait(group->allreduce(t, comm::ReduceOp::kMax));
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  auto min_over_group = [&each_rank](int64_t v) {
    const std::vector<int64_t> all = each_rank(v);
    return *std::min_element(all.begin(), all.end());
  };
  // A rank that cannot read its files (other than a torn or damaged one) takes part with kUnreadable, so that every
  // rank fails instead of agreeing on an older step or a fresh start; that rank's error says why.
  constexpr int64_t kUnreadable = -2;
  auto unreadable = [&](const absl::Status& own) {
    if (!own.ok()) throw_error(own);
    throw_error(
        absl::UnavailableError(absl::StrCat("checkpoint: another rank of the group could not read its files of ", dir_,
                                            " (its error says why); not restored")));
  };
  int64_t bound = std::numeric_limits<int64_t>::max();
  int64_t first_newest = -1;  // the newest intact step any rank had in the first round
  for (;;) {
    auto mine = newest_intact_at_most(bound, source);  // the file is read once, and loaded from memory if agreed on
    const std::vector<int64_t> newest = each_rank(!mine.ok() ? kUnreadable : *mine ? (*mine)->first : -1);
    const int64_t agreed = *std::min_element(newest.begin(), newest.end());
    if (agreed == kUnreadable) unreadable(mine.status());
    if (bound == std::numeric_limits<int64_t>::max()) first_newest = *std::max_element(newest.begin(), newest.end());
    if (agreed < 0) {
      const int64_t most = *std::max_element(newest.begin(), newest.end());
      if (most < 0 && first_newest >= 0) {
        // Every rank had steps, but none that every rank has intact (each lacks another's): no fresh start either.
        throw_error(absl::FailedPreconditionError(
            absl::StrCat("checkpoint: the ranks of the group have steps in ", dir_, " (up to step ", first_newest,
                         ") but none that every rank has intact: not restored, and not started afresh beside them")));
      }
      if (most < 0) return std::nullopt;  // no rank has a step: a fresh start
      // Some ranks have steps and others none they share: starting afresh would drop the others' state silently (a
      // job grown under Layout::kPerRank, a directory rank 0 does not share under kReplicated, a rank whose every
      // file is damaged).
      std::vector<std::string> without;
      for (size_t r = 0; r < newest.size(); ++r) {
        if (newest[r] < 0) without.push_back(std::to_string(r));
      }
      throw_error(absl::FailedPreconditionError(absl::StrCat(
          "checkpoint: rank(s) ", absl::StrJoin(without, ", "), " of the group have no intact step",
          bound == std::numeric_limits<int64_t>::max() ? "" : absl::StrCat(" up to ", bound), " of ",
          layout == Layout::kReplicated ? "rank 0's files in " : "their own in ", dir_,
          " while others have (up to step ", most,
          "): not restored, and not started afresh beside them (a job of another world size resumes with "
          "Layout::kReplicated from a directory every rank shares; a fresh start takes an empty directory)")));
    }
    absl::StatusOr<std::string> payload = *mine && (*mine)->first == agreed
                                              ? absl::StatusOr<std::string>(std::move((*mine)->second))
                                              : read_payload(path_of(agreed, source));
    const bool damaged = !payload.ok() && absl::IsDataLoss(payload.status());
    const int64_t read = min_over_group(payload.ok() ? 1 : damaged ? 0 : -1);
    if (read < 0) unreadable(damaged ? absl::OkStatus() : payload.status());
    if (read == 1) {
      load_payload(path_of(agreed, source), *payload, state);
      return agreed;
    }
    bound = agreed - 1;
  }
}

std::vector<std::pair<std::string, at::Tensor>> consolidate_fsdp(const std::string& dir, int64_t step,
                                                                 const std::string& item) {
  std::vector<fsdp::FullyShardedDataParallel::ShardedStateDict> ranks;
  int64_t world = 1;
  for (int64_t r = 0; r < world; ++r) {
    State state;
    state.add(
        item, [](torch::serialize::OutputArchive&) {},
        [&](torch::serialize::InputArchive& a) { ranks.push_back(read_fsdp_sharded(item, a)); });
    Checkpointer(dir, static_cast<int>(r)).load(step, state);
    if (r == 0) world = ranks[0].world_size;
  }
  return fsdp::FullyShardedDataParallel::consolidate(ranks);
}

}  // namespace tandem::checkpoint
