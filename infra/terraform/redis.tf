# One Redis for the campaign: heartbeats, the rendezvous store and the hang view
# (reliability.redis_url=redis://megatrain-redis:6379/0 in configs/campaign-cluster.yaml).
# Nothing in it outlives a restart that matters: ranks re-register, so no persistence.
# It requires the generated password (security.tf); the configuration reaches redis-server on
# stdin, so the password is on no command line, and only the campaign's pods may connect.
locals {
  redis_name   = "megatrain-redis"
  redis_port   = 6379
  redis_labels = { "app.kubernetes.io/name" = "megatrain-redis", "app.kubernetes.io/part-of" = "megatrain" }
}

resource "kubernetes_deployment_v1" "redis" {
  metadata {
    name      = local.redis_name
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
    labels    = local.redis_labels
  }

  spec {
    replicas = 1
    selector {
      match_labels = local.redis_labels
    }
    template {
      metadata {
        labels = local.redis_labels
      }
      spec {
        container {
          name  = "redis"
          image = var.redis_image
          # `redis-server -` reads the requirepass line from the here-document, then the options
          command = ["sh", "-c", <<-EOT
            exec redis-server - --save '' --appendonly no --maxclients 100000 <<EOF
            requirepass $MEGATRAIN_REDIS_PASSWORD
            EOF
          EOT
          ]
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.redis_auth.metadata[0].name
            }
          }
          port {
            container_port = local.redis_port
          }
          resources {
            requests = { cpu = "2", memory = var.redis_memory }
            limits   = { memory = var.redis_memory }
          }
          readiness_probe {
            tcp_socket {
              port = local.redis_port
            }
            period_seconds = 5
          }
        }
      }
    }
  }
}

resource "kubernetes_service_v1" "redis" {
  metadata {
    name      = local.redis_name
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
    labels    = local.redis_labels
  }
  spec {
    selector = local.redis_labels
    port {
      port        = local.redis_port
      target_port = local.redis_port
    }
  }
}
