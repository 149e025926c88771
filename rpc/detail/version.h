// The version of Tandem's wire schema (proto/tandem_rpc.proto): two builds with different versions never exchange a
// message they could misread; each place where they first meet refuses the other with FAILED_PRECONDITION naming both.
#pragma once

#include <cstdint>

namespace tandem::rpc {

// 1: the schema before versioning (hand-made rendezvous, hello, RRef and autograd encodings). 2: all of them in proto/.
// 3: the pipeline's micro-batches are argument tuples, its activations and gradients structured values; the direct
// channel's one-way request (kind 6). 4: a pipeline step's workers tell each other they finished (done), no commit.
// 5: a pipeline plan's actions carry a kind (F, B, I, W: the zero-bubble split), not a backward flag.
// 6: the releases of a pipeline's stages and of a distributed optimizer's shards take a list of ids.
// 7: a distributed optimizer's creation carries its id and timeout first; a reference its owner sends is accepted by
// its receiver (accept), as user-sent ones are. 8: a request with tensors sent by reference carries the caller's lease
// on them (lease.h); the direct channel's Unix-socket handshake is the TCP one (a challenge, proofs, no token).
constexpr uint32_t kWireVersion = 8;

}  // namespace tandem::rpc
