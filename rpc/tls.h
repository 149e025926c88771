// TLS for a job's connections (RpcOptions::tls): every worker presents a certificate and verifies its peers'.
#pragma once

#include <string>

namespace tandem::rpc {

struct TlsOptions {
  std::string cert_chain_path;       // this worker's certificate (PEM)
  std::string private_key_path;      // its key (PEM)
  std::string root_certs_path;       // CA that signed the job's certificates (PEM); peers are verified against it
  std::string target_name_override;  // name to verify in peers' certificates instead of the dialled host (optional)
};

}  // namespace tandem::rpc
