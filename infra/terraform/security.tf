# Who may get in: generated credentials (never a literal in these files) and network policies.
#
# - Redis: a generated password, in the Secret megatrain-redis-auth as MEGATRAIN_REDIS_PASSWORD,
#   the variable every megatrain Redis client reads (megatrain/launch/redis_client.py). The Redis
#   pod, the flow-run pods (infra/k8s/base-job-template.json), the rank pods (tasks/kubernetes.py)
#   and the Dask workers load it as environment; it is never in a config file or on a command line.
# - Prefect: the server runs with basic auth from the Secret megatrain-prefect-auth (the chart's
#   key `auth-string`); the worker and the flow-run pods send it (PREFECT_API_AUTH_STRING).
#   `terraform output -raw prefect_ui_password` gives an operator the UI password (README.md).
# - Dask: TLS with certificates made here (dask_tls below) and mounted from megatrain-dask-tls.
# - Network: nothing in the namespace accepts a connection unless a policy below lets it in.
#   Redis, the Dask scheduler and workers and the ranks' rendezvous and NCCL ports accept only the
#   namespace's megatrain pods (label app.kubernetes.io/part-of=megatrain: flow runs, ranks, Dask);
#   the Prefect server accepts its worker, the flow runs and the ingress controller's namespace.
#   One campaign per namespace keeps campaigns apart from each other too.
locals {
  member_labels = { "app.kubernetes.io/part-of" = "megatrain" }
  # what tasks/kubernetes.py labels a stage's rank pods with
  rank_labels = { "app.kubernetes.io/name" = "megatrain" }
  # the prefect-server chart's pod labels (fullnameOverride prefect-server)
  prefect_server_labels = { "app.kubernetes.io/name" = "prefect-server" }
  prefect_worker_labels = { "app.kubernetes.io/name" = "prefect-worker" }
}

resource "random_password" "redis" {
  length  = 40
  special = false # it travels in a redis:// client's AUTH and a shell here-document: keep it plain
}

resource "kubernetes_secret_v1" "redis_auth" {
  metadata {
    name      = "megatrain-redis-auth"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  data = { MEGATRAIN_REDIS_PASSWORD = random_password.redis.result }
}

resource "random_password" "prefect_ui" {
  length  = 32
  special = false
}

resource "kubernetes_secret_v1" "prefect_auth" {
  metadata {
    name      = "megatrain-prefect-auth"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  # `auth-string` for the charts; the two variables for the flow-run pods' Prefect client and server settings
  data = {
    "auth-string"                  = "admin:${random_password.prefect_ui.result}"
    PREFECT_API_AUTH_STRING        = "admin:${random_password.prefect_ui.result}"
    PREFECT_SERVER_API_AUTH_STRING = "admin:${random_password.prefect_ui.result}"
  }
}

# ---------------------------------------------------------------------------------------------
# Dask TLS: a private CA and one certificate for scheduler, workers and clients (the flow runs).
# Made by Terraform's tls provider, so nothing is to be done by hand; to bring your own instead,
# make them with openssl (infra/terraform/README.md, "Dask TLS") and
# `kubectl -n megatrain create secret generic megatrain-dask-tls --from-file=ca.pem --from-file=tls.crt --from-file=tls.key`.

resource "tls_private_key" "dask_ca" {
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_self_signed_cert" "dask_ca" {
  private_key_pem       = tls_private_key.dask_ca.private_key_pem
  is_ca_certificate     = true
  validity_period_hours = 24 * 365
  allowed_uses          = ["cert_signing", "crl_signing"]
  subject {
    common_name = "megatrain-dask-ca"
  }
}

resource "tls_private_key" "dask" {
  algorithm   = "ECDSA"
  ecdsa_curve = "P256"
}

resource "tls_cert_request" "dask" {
  private_key_pem = tls_private_key.dask.private_key_pem
  dns_names       = [local.dask_scheduler_name, "${local.dask_scheduler_name}.${var.namespace}.svc.cluster.local"]
  subject {
    common_name = local.dask_scheduler_name
  }
}

resource "tls_locally_signed_cert" "dask" {
  cert_request_pem      = tls_cert_request.dask.cert_request_pem
  ca_private_key_pem    = tls_private_key.dask_ca.private_key_pem
  ca_cert_pem           = tls_self_signed_cert.dask_ca.cert_pem
  validity_period_hours = 24 * 365
  allowed_uses          = ["digital_signature", "key_encipherment", "server_auth", "client_auth"]
}

resource "kubernetes_secret_v1" "dask_tls" {
  metadata {
    name      = "megatrain-dask-tls"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  data = {
    "ca.pem"  = tls_self_signed_cert.dask_ca.cert_pem
    "tls.crt" = tls_locally_signed_cert.dask.cert_pem
    "tls.key" = tls_private_key.dask.private_key_pem
  }
}

# ---------------------------------------------------------------------------------------------
# Network policies.

resource "kubernetes_network_policy_v1" "default_deny" {
  metadata {
    name      = "megatrain-default-deny-ingress"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {}
    policy_types = ["Ingress"]
  }
}

resource "kubernetes_network_policy_v1" "redis" {
  metadata {
    name      = "megatrain-redis"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.redis_labels
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {
          match_labels = local.member_labels
        }
      }
      ports {
        port     = local.redis_port
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "dask_scheduler" {
  metadata {
    name      = "megatrain-dask-scheduler"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.dask_scheduler_labels
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {
          match_labels = local.member_labels
        }
      }
      ports {
        port     = local.dask_scheduler_port
        protocol = "TCP"
      }
      ports {
        port     = local.dask_dashboard_port
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "dask_workers" {
  metadata {
    name      = "megatrain-dask-workers"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.dask_worker_labels
    }
    policy_types = ["Ingress"]
    ingress { # the scheduler and peer workers (data transfers) on any port the worker listens on
      from {
        pod_selector {
          match_labels = local.member_labels
        }
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "ranks" {
  metadata {
    name      = "megatrain-ranks"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.rank_labels
    }
    policy_types = ["Ingress"]
    # the rendezvous port and NCCL/gloo's own (dynamic) ports: from the namespace's megatrain pods only
    ingress {
      from {
        pod_selector {
          match_labels = local.member_labels
        }
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "prefect_server" {
  count = local.install_server ? 1 : 0
  metadata {
    name      = "megatrain-prefect-server"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  spec {
    pod_selector {
      match_labels = local.prefect_server_labels
    }
    policy_types = ["Ingress"]
    ingress {
      from { # the worker
        pod_selector {
          match_labels = local.prefect_worker_labels
        }
      }
      from { # the flow runs (their states, logs and artifacts)
        pod_selector {
          match_labels = local.member_labels
        }
      }
      from { # the UI, through the ingress controller
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = var.ingress_namespace }
        }
      }
      ports {
        port     = 4200
        protocol = "TCP"
      }
    }
  }
}
