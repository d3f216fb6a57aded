# A dask.distributed cluster for the shard-data flow's `data.engine: dask` (flows/shard_data.py):
# the flow maps a corpus's work units (files, Parquet row groups, byte ranges) as Prefect tasks on
# a DaskTaskRunner at data.dask_address=tcp://megatrain-dask-scheduler:8786
# (configs/campaign-cluster.yaml). Scheduler and workers run the megatrain image: the tasks import
# megatrain and tasks/, and client, scheduler and workers need the same Python, dask and
# distributed. One single-threaded worker process per pod (the tokenizer uses one core per
# process): scale with var.dask_workers. A worker lost mid-unit costs that unit only.
# Every connection is TLS with the certificates of the Secret megatrain-dask-tls (security.tf),
# mounted at /etc/dask-tls; the flow runs find them through the ConfigMap megatrain-dask-client
# (Dask's own configuration variables), so flows/shard_data.py needs no code for it.
locals {
  dask_scheduler_name    = "megatrain-dask-scheduler"
  dask_scheduler_port    = 8786
  dask_dashboard_port    = 8787 # the Service is ClusterIP: kubectl port-forward to look at it
  dask_worker_http_port  = 8789 # the worker's /health, for its readiness probe
  dask_scheduler_address = "tls://${local.dask_scheduler_name}:${local.dask_scheduler_port}"
  dask_tls_dir           = "/etc/dask-tls"
  dask_scheduler_labels  = { "app.kubernetes.io/name" = "megatrain-dask-scheduler", "app.kubernetes.io/part-of" = "megatrain" }
  dask_worker_labels     = { "app.kubernetes.io/name" = "megatrain-dask-worker", "app.kubernetes.io/part-of" = "megatrain" }
}

resource "kubernetes_deployment_v1" "dask_scheduler" {
  metadata {
    name      = local.dask_scheduler_name
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
    labels    = local.dask_scheduler_labels
  }

  spec {
    replicas = 1
    selector {
      match_labels = local.dask_scheduler_labels
    }
    template {
      metadata {
        labels = local.dask_scheduler_labels
      }
      spec {
        container {
          name  = "scheduler"
          image = var.megatrain_image
          command = [
            "dask", "scheduler", "--protocol", "tls", "--port", "${local.dask_scheduler_port}",
            "--dashboard-address", ":${local.dask_dashboard_port}",
            "--tls-ca-file", "${local.dask_tls_dir}/ca.pem", "--tls-cert", "${local.dask_tls_dir}/tls.crt",
            "--tls-key", "${local.dask_tls_dir}/tls.key",
          ]
          volume_mount {
            name       = "dask-tls"
            mount_path = local.dask_tls_dir
            read_only  = true
          }
          port {
            name           = "comm"
            container_port = local.dask_scheduler_port
          }
          port {
            name           = "dashboard"
            container_port = local.dask_dashboard_port
          }
          resources {
            requests = { cpu = var.dask_scheduler_cpu, memory = var.dask_scheduler_memory }
            limits   = { memory = var.dask_scheduler_memory }
          }
          readiness_probe {
            tcp_socket {
              port = local.dask_scheduler_port
            }
            period_seconds = 5
          }
        }
        volume {
          name = "dask-tls"
          secret {
            secret_name = kubernetes_secret_v1.dask_tls.metadata[0].name
          }
        }
      }
    }
  }
}

resource "kubernetes_service_v1" "dask_scheduler" {
  metadata {
    name      = local.dask_scheduler_name
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
    labels    = local.dask_scheduler_labels
  }
  spec {
    type     = "ClusterIP"
    selector = local.dask_scheduler_labels
    port {
      name        = "comm"
      port        = local.dask_scheduler_port
      target_port = local.dask_scheduler_port
    }
    port {
      name        = "dashboard"
      port        = local.dask_dashboard_port
      target_port = local.dask_dashboard_port
    }
  }
}

resource "kubernetes_deployment_v1" "dask_worker" {
  metadata {
    name      = "megatrain-dask-worker"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
    labels    = local.dask_worker_labels
  }

  spec {
    replicas = var.dask_workers
    selector {
      match_labels = local.dask_worker_labels
    }
    template {
      metadata {
        labels = local.dask_worker_labels
      }
      spec {
        container {
          name  = "worker"
          image = var.megatrain_image
          # --memory-limit = the container's limit: Dask spills, pauses and restarts the worker
          # process before the kernel's OOM killer takes the pod
          command = [
            "dask", "worker", local.dask_scheduler_address,
            "--nworkers", "1", "--nthreads", "1", "--memory-limit", var.dask_worker_memory,
            "--dashboard-address", ":${local.dask_worker_http_port}",
            "--tls-ca-file", "${local.dask_tls_dir}/ca.pem", "--tls-cert", "${local.dask_tls_dir}/tls.crt",
            "--tls-key", "${local.dask_tls_dir}/tls.key",
          ]
          volume_mount {
            name       = "dask-tls"
            mount_path = local.dask_tls_dir
            read_only  = true
          }
          env {
            name  = "TOKENIZERS_PARALLELISM"
            value = "false"
          }
          env {
            name  = "OMP_NUM_THREADS"
            value = "1"
          }
          # the durable store's credentials, as the flow-run pods and the ranks load them
          env_from {
            secret_ref {
              name     = kubernetes_secret_v1.storage.metadata[0].name
              optional = true
            }
          }
          port {
            name           = "http"
            container_port = local.dask_worker_http_port
          }
          resources {
            requests = { cpu = var.dask_worker_cpu, memory = var.dask_worker_memory }
            limits   = { memory = var.dask_worker_memory }
          }
          readiness_probe {
            http_get {
              path = "/health"
              port = local.dask_worker_http_port
            }
            period_seconds = 5
          }
        }
        volume {
          name = "dask-tls"
          secret {
            secret_name = kubernetes_secret_v1.dask_tls.metadata[0].name
          }
        }
      }
    }
  }
}

# Dask's configuration for the flow runs' client (infra/k8s/base-job-template.json loads it)
resource "kubernetes_config_map_v1" "dask_client" {
  metadata {
    name      = "megatrain-dask-client"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  data = {
    DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION = "true"
    DASK_DISTRIBUTED__COMM__TLS__CA_FILE       = "${local.dask_tls_dir}/ca.pem"
    DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT  = "${local.dask_tls_dir}/tls.crt"
    DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY   = "${local.dask_tls_dir}/tls.key"
  }
}
