{{/* Names */}}
{{- define "colibri.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "colibri.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "colibri.routerName" -}}{{ include "colibri.fullname" . }}-router{{- end -}}
{{- /* at most 52 characters: the StatefulSet's pods carry "controller-revision-hash: <name>-<10 characters>", a
label value of at most 63 (a longer name: no pod is ever made) */}}
{{- define "colibri.expertsName" -}}{{ include "colibri.fullname" . | trunc 44 | trimSuffix "-" }}-experts{{- end -}}
{{- define "colibri.openaiName" -}}{{ include "colibri.fullname" . }}-openai{{- end -}}

{{/* The router Service's in-cluster address: the name its TLS certificate carries. */}}
{{- define "colibri.routerAddress" -}}
{{ include "colibri.routerName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.router.port | int64 }}
{{- end -}}

{{- define "colibri.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Labels */}}
{{- define "colibri.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "colibri.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "colibri.selector" -}}
app.kubernetes.io/name: {{ include "colibri.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The experts' headless Service (experts.placement router: the router's --follow-workers; it resolves to one
     address per expert pod, named <pod>.<experts>.<ns>.svc.<domain> by its reverse record). */}}
{{- define "colibri.expertsServiceAddress" -}}
{{ include "colibri.expertsName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.experts.port | int64 }}
{{- end -}}

{{/* The router's --workers list: the StatefulSet pods' stable DNS names, one per shard. */}}
{{- define "colibri.workerAddresses" -}}
{{- $sts := include "colibri.expertsName" . -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.experts.shards) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $sts $i $sts $.Release.Namespace $.Values.clusterDomain (int $.Values.experts.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* Volumes every Colibri pod mounts: the model (read-only), /tmp, /dev/shm. */}}
{{- define "colibri.volumes" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.init.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "colibri.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "colibri.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "colibri.initContainers" -}}
{{- if eq .Values.model.source "init" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.init.image | quote }}
    command: {{ toJson .Values.model.init.command }}
    env:
      - name: MODEL_SOURCE
        value: {{ .Values.model.init.source | quote }}
      - name: MODEL_DIR
        value: {{ .Values.model.mountPath | quote }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{- define "colibri.env" -}}
- name: HOME
  value: /tmp
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: PYTHONUNBUFFERED
  value: "1"
- name: OMP_WAIT_POLICY
  value: PASSIVE
{{- end -}}

{{- define "colibri.resources" -}}
{{- $res := deepCopy .resources -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := default dict $res.limits -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* TLS: where the Secret comes from (existing | certManager | generated), its name, the names its certificate
     carries, and the generated material. */}}
{{- define "colibri.tlsSource" -}}
{{- if .Values.tls.existingSecret -}}existing
{{- else if .Values.tls.certManager.enabled -}}certManager
{{- else -}}generated
{{- end -}}
{{- end -}}

{{- define "colibri.tlsSecretName" -}}
{{- if .Values.tls.secretName -}}
{{- fail "tls.secretName is now tls.existingSecret (without either the chart makes the certificates)" -}}
{{- end -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "colibri.fullname" .)) -}}
{{- end -}}

{{/* Comma-separated: the router Service (every short form) and every worker pod behind the headless Service
     (the router dials <experts>-<i>.<experts>.<ns>.svc.<domain>; the workers' probes name probe.<experts>...). */}}
{{- define "colibri.tlsDnsNames" -}}
{{- $ns := .Release.Namespace -}}
{{- $router := include "colibri.routerName" . -}}
{{- $experts := include "colibri.expertsName" . -}}
{{- $names := list $router (printf "%s.%s" $router $ns) (printf "%s.%s.svc" $router $ns)
      (printf "%s.%s.svc.%s" $router $ns .Values.clusterDomain)
      (printf "*.%s.%s.svc" $experts $ns) (printf "*.%s.%s.svc.%s" $experts $ns .Values.clusterDomain) -}}
{{- $extra := list -}}
{{- range .Values.tls.extraDnsNames }}{{ if not (include "colibri.isIp" .) }}{{ $extra = append $extra . }}{{ end }}{{ end -}}
{{- concat $names $extra | uniq | join "," -}}
{{- end -}}

{{/* tls.extraDnsNames that are IP addresses: the certificate's IP SANs (as DNS names, clients that verify an IP
     refused them) */}}
{{- define "colibri.isIp" -}}
{{- if or (regexMatch "^[0-9]+(\\.[0-9]+){3}$" .) (contains ":" .) }}true{{ end -}}
{{- end -}}
{{- define "colibri.tlsIps" -}}
{{- $ips := list -}}
{{- range .Values.tls.extraDnsNames }}{{ if include "colibri.isIp" . }}{{ $ips = append $ips . }}{{ end }}{{ end -}}
{{- $ips | uniq | join "," -}}
{{- end -}}

{{/* What the certificate was made for, kept on the generated Secret: its names, then its IPs where it has some */}}
{{- define "colibri.tlsNames" -}}
{{- include "colibri.tlsDnsNames" . -}}{{ with include "colibri.tlsIps" . }}|{{ . }}{{ end -}}
{{- end -}}

{{/* The generated Secret's data (JSON, base64 values): the Secret already in the cluster when it was made for
     the same names (so upgrades keep it), else a new CA and a certificate it signs for server and client
     use. Made once per render and kept in .Values: the Secret and the pods' checksum see the same bytes. */}}
{{- define "colibri.tlsGenerated" -}}
{{- if not (hasKey .Values "_colibriTls") -}}
{{- $names := include "colibri.tlsNames" . -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "colibri.tlsSecretName" .) | default dict -}}
{{- $oldData := get $old "data" | default dict -}}
{{- $oldNames := get (get (get $old "metadata" | default dict) "annotations" | default dict) "colibri.io/tls-names" -}}
{{- $data := dict -}}
{{- if and (eq $oldNames $names) (hasKey $oldData "ca.crt") (hasKey $oldData "tls.crt") (hasKey $oldData "tls.key") -}}
{{- $data = pick $oldData "ca.crt" "tls.crt" "tls.key" -}}
{{- else -}}
{{- $days := int .Values.tls.validityDays -}}
{{- $ca := genCAWithKey (printf "%s-ca" (include "colibri.fullname" .)) $days (genPrivateKey "ecdsa") -}}
{{- $dns := list -}}
{{- range splitList "," (include "colibri.tlsDnsNames" .) }}{{ $dns = append $dns . }}{{ end -}}
{{- $ips := list -}}
{{- range splitList "," (include "colibri.tlsIps" .) }}{{ if . }}{{ $ips = append $ips . }}{{ end }}{{ end -}}
{{- $cert := genSignedCertWithKey (include "colibri.fullname" .) $ips $dns $days $ca (genPrivateKey "ecdsa") -}}
{{- $data = dict "ca.crt" ($ca.Cert | b64enc) "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) -}}
{{- end -}}
{{- $_ := set .Values "_colibriTls" $data -}}
{{- end -}}
{{- toJson .Values._colibriTls -}}
{{- end -}}

{{/* The Host names the OpenAI front answers: its Service's (every short form), its pod's IP (kubelet's probes,
     Prometheus), localhost (port-forward), and openai.allowedHosts. */}}
{{- define "colibri.openaiHosts" -}}
{{- $svc := include "colibri.openaiName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $hosts := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns)
      (printf "%s.%s.svc.%s" $svc $ns .Values.clusterDomain) "$(POD_IP)" "localhost" "127.0.0.1" -}}
{{- concat $hosts (.Values.openai.allowedHosts | default list) | uniq | join "," -}}
{{- end -}}

{{/* The OpenAI front's API key Secret, and its generated data (kept across upgrades like the TLS Secret). */}}
{{- define "colibri.apiKeySecretName" -}}
{{- .Values.openai.apiKey.existingSecret | default (printf "%s-api-key" (include "colibri.openaiName" .)) -}}
{{- end -}}

{{- define "colibri.apiKeyGenerated" -}}
{{- if not (hasKey .Values "_colibriApiKey") -}}
{{- $key := .Values.openai.apiKey.secretKey -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "colibri.apiKeySecretName" .) | default dict -}}
{{- $oldData := get $old "data" | default dict -}}
{{- $_ := set .Values "_colibriApiKey" (dict $key (get $oldData $key | default (randAlphaNum 48 | b64enc))) -}}
{{- end -}}
{{- toJson .Values._colibriApiKey -}}
{{- end -}}

{{/* The fleet token Secret (env COLIBRI_FLEET_TOKEN of the router and the workers), and its generated data (kept
     across upgrades like the TLS Secret). */}}
{{- define "colibri.fleetTokenSecretName" -}}
{{- .Values.fleetToken.existingSecret | default (printf "%s-fleet-token" (include "colibri.fullname" .)) -}}
{{- end -}}

{{- define "colibri.fleetTokenGenerated" -}}
{{- if not (hasKey .Values "_colibriFleetToken") -}}
{{- $key := .Values.fleetToken.secretKey -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "colibri.fleetTokenSecretName" .) | default dict -}}
{{- $oldData := get $old "data" | default dict -}}
{{- $_ := set .Values "_colibriFleetToken" (dict $key (get $oldData $key | default (randAlphaNum 48 | b64enc))) -}}
{{- end -}}
{{- toJson .Values._colibriFleetToken -}}
{{- end -}}

{{- define "colibri.fleetTokenEnv" -}}
- name: COLIBRI_FLEET_TOKEN      # shared by router and workers: a worker refuses calls without it
  valueFrom:
    secretKeyRef:
      name: {{ include "colibri.fleetTokenSecretName" . }}
      key: {{ .Values.fleetToken.secretKey }}
{{- end -}}

{{/* Pod annotations: podAnnotations, and checksums of the Secrets the chart makes, so new material restarts every
     pod that reads it (router and workers must trust the same CA and hold the same fleet token; processes read
     both at start).
     dict: root, component. */}}
{{- define "colibri.podAnnotations" -}}
{{- $root := .root -}}
{{- $ann := deepCopy ($root.Values.podAnnotations | default dict) -}}
{{- if and $root.Values.tls.enabled (eq (include "colibri.tlsSource" $root) "generated") -}}
{{- $_ := set $ann "checksum/tls" (include "colibri.tlsGenerated" $root | sha256sum) -}}
{{- end -}}
{{- if and (has .component (list "router" "experts")) (not $root.Values.fleetToken.existingSecret) -}}
{{- $_ := set $ann "checksum/fleet-token" (include "colibri.fleetTokenGenerated" $root | sha256sum) -}}
{{- end -}}
{{- $apiKey := $root.Values.openai.apiKey -}}
{{- if and (eq .component "openai") $apiKey.enabled (not $apiKey.existingSecret) -}}
{{- $_ := set $ann "checksum/api-key" (include "colibri.apiKeyGenerated" $root | sha256sum) -}}
{{- end -}}
{{- with $ann -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* TLS flags of a service (a kubernetes.io/tls Secret with ca.crt, as cert-manager writes it). */}}
{{- define "colibri.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end -}}

{{/* A health probe: kubelet's native gRPC probe, or (its probes cannot speak TLS) `colibri health` over
     TLS from inside the pod. dict: root, port, service, serverName. */}}
{{- define "colibri.probe" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command:
    - colibri
    - health
    - --target=127.0.0.1:{{ .port }}
    - --timeout=5
    - --service={{ .service }}
    - --tls-ca={{ .root.Values.tls.mountPath }}/ca.crt
    - --tls-cert={{ .root.Values.tls.mountPath }}/tls.crt
    - --tls-key={{ .root.Values.tls.mountPath }}/tls.key
    - --tls-server-name={{ .serverName }}
timeoutSeconds: 10                   # a Python process on a busy node: more than kubelet's 1 s default
{{- else -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
timeoutSeconds: 5                    # a Python process on a busy node: more than kubelet's 1 s default
{{- end }}
{{- end -}}

{{/* --threads: the value given, or with 0 the container's CPU request rounded up ("2", 2, "1500m"), else its CPU
     limit (which Kubernetes then takes as the request); 0 where it has neither. torch's own default is the node's
     cores, which a container without a CPU limit does not own.
     dict: threads, resources. */}}
{{- define "colibri.threads" -}}
{{- $cpu := "" -}}
{{- with .resources -}}
{{- with .requests -}}{{- $cpu = toString (default "" .cpu) -}}{{- end -}}
{{- if not $cpu -}}{{- with .limits -}}{{- $cpu = toString (default "" .cpu) -}}{{- end -}}{{- end -}}
{{- end -}}
{{- if gt (int .threads) 0 -}}
{{- .threads | int64 -}}
{{- else if hasSuffix "m" $cpu -}}
{{- max 1 (int (ceil (divf (float64 (trimSuffix "m" $cpu)) 1000.0))) -}}
{{- else if $cpu -}}
{{- max 1 (int (ceil (float64 $cpu))) -}}
{{- else -}}
0
{{- end -}}
{{- end -}}

{{/* Checks between values that the schema cannot state: each fails the render naming the values and what to set
(each was a manifest the API server, the scheduler or the colibri CLI refused after the install). */}}
{{- define "colibri.checks" -}}
{{- $v := .Values -}}
{{- if regexMatch "^[0-9]" .Release.Name }}
{{- fail (printf "release name %s starts with a digit: its Services' names (%s-...) must start with a letter (DNS-1035)" .Release.Name .Release.Name) }}
{{- end }}
{{- if and (gt (int $v.router.gpus) 0) $v.model.quantize }}
{{- fail (printf "model.quantize=%s is the CPU path (int8 CPU kernels) and router.gpus=%d puts the router on a GPU, which the router refuses: set router.gpus=0, or drop model.quantize" $v.model.quantize (int $v.router.gpus)) }}
{{- end }}
{{- range $name := list "router" "experts" }}
{{- $c := get $v $name }}
{{- if eq (int $c.port) (int $c.metricsPort) }}
{{- fail (printf "%s.port and %s.metricsPort are both %d: one port cannot serve gRPC and the metrics; give them different ports" $name $name (int $c.port)) }}
{{- end }}
{{- end }}
{{- $scaled := dict "router.autoscaling" (list $v.router.autoscaling.enabled $v.router.autoscaling.minReplicas $v.router.autoscaling.maxReplicas "minReplicas" "maxReplicas") "openai.autoscaling" (list (and $v.openai.enabled $v.openai.autoscaling.enabled) $v.openai.autoscaling.minReplicas $v.openai.autoscaling.maxReplicas "minReplicas" "maxReplicas") "experts.autoscaling" (list $v.experts.autoscaling.enabled $v.experts.autoscaling.minReplicas $v.experts.autoscaling.maxReplicas "minReplicas" "maxReplicas") "router.keda" (list $v.router.keda.enabled $v.router.keda.minReplicaCount $v.router.keda.maxReplicaCount "minReplicaCount" "maxReplicaCount") }}
{{- range $name := list "router" "experts" "openai" }}
{{- $c := get $v $name }}
{{- if and $c.autoscaling.enabled (or (ne $name "openai") $v.openai.enabled) }}
{{- $res := $c.resources | default dict }}
{{- if not (or (($res.requests | default dict).cpu) (($res.limits | default dict).cpu)) }}
{{- fail (printf "%s.autoscaling scales on CPU utilisation, a share of the pods' CPU request, and %s.resources sets none: set %s.resources.requests.cpu (the HPA would report FailedGetResourceMetric and never scale)" $name $name $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $s := $scaled }}
{{- if and (index $s 0) (gt (int (index $s 1)) (int (index $s 2))) }}
{{- fail (printf "%s.%s (%d) is more than %s.%s (%d)" $name (index $s 3) (int (index $s 1)) $name (index $s 4) (int (index $s 2))) }}
{{- end }}
{{- end }}
{{- $pod := $v.podSecurityContext | default dict }}{{ $ctr := $v.securityContext | default dict }}
{{- $nonRoot := ternary $ctr.runAsNonRoot $pod.runAsNonRoot (hasKey $ctr "runAsNonRoot") }}
{{- $user := ternary $ctr.runAsUser $pod.runAsUser (hasKey $ctr "runAsUser") }}
{{- if and $nonRoot (not (kindIs "invalid" $user)) (eq (int $user) 0) }}
{{- fail "runAsUser 0 (root) with runAsNonRoot: true: kubelet would refuse to start every container (CreateContainerConfigError); set podSecurityContext.runAsUser to the image's user (10001), or runAsNonRoot: false" }}
{{- end }}
{{- /* every pair of the pods' mounts: the API refuses two at one path, and one inside another hides it */}}
{{- $mounts := list (list (clean $v.model.mountPath) (printf "model.mountPath %s" $v.model.mountPath)) (list "/tmp" "the pods' scratch volume") (list "/dev/shm" "shm") }}
{{- if $v.tls.enabled }}{{ $mounts = append $mounts (list (clean $v.tls.mountPath) (printf "tls.mountPath %s" $v.tls.mountPath)) }}{{ end }}
{{- range $i, $a := $mounts }}
{{- range $j, $b := $mounts }}
{{- if lt $i $j }}
{{- $pa := index $a 0 }}{{ $pb := index $b 0 }}
{{- if or (eq $pa $pb) (hasPrefix (printf "%s/" (trimSuffix "/" $pa)) $pb) (hasPrefix (printf "%s/" (trimSuffix "/" $pb)) $pa) }}
{{- fail (printf "%s overlaps %s at %s: give each a path of its own (the checkpoint at /models/model, its TLS files at /etc/colibri/tls, say)" (index $a 1) (index $b 1) (ternary $pb $pa (hasPrefix (printf "%s/" (trimSuffix "/" $pa)) $pb))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq $v.model.source "init") (not (trim (toString $v.model.init.source))) }}
{{- fail "model.source=init: set model.init.source, what model.init.command copies the checkpoint from (s3://..., https://..., or a path inside model.init.image)" }}
{{- end }}
{{- $owned := dict "router" (list "--model" "--host" "--port" "--metrics-port" "--workers" "--follow-workers" "--tls-cert" "--tls-key" "--tls-ca" "--tls-client-auth" "--grace-period" "--device") "experts" (list "--model" "--host" "--port" "--metrics-port" "--shard" "--tls-cert" "--tls-key" "--tls-ca" "--device") "openai" (list "--target" "--host" "--port" "--tls-ca" "--tls-cert" "--tls-key" "--grace-period") }}
{{- range $name, $flags := $owned }}
{{- range (get $v $name).extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" }}
{{- if has $flag $flags }}
{{- fail (printf "%s.extraArgs sets %s, which the chart sets itself (its probes, Services and the other pods follow the chart's value): set it through the chart's values instead" $name $flag) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
