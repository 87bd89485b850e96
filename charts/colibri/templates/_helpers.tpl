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
{{- define "colibri.expertsName" -}}{{ include "colibri.fullname" . }}-experts{{- end -}}
{{- define "colibri.openaiName" -}}{{ include "colibri.fullname" . }}-openai{{- end -}}

{{/* The router Service's in-cluster address: the name its TLS certificate carries. */}}
{{- define "colibri.routerAddress" -}}
{{ include "colibri.routerName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.router.port }}
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
    secretName: {{ required "tls.secretName: a kubernetes.io/tls Secret with ca.crt (cert-manager's)" .Values.tls.secretName }}
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
    image: {{ .Values.model.init.image }}
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
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - colibri
    - health
    - --target=127.0.0.1:{{ .port }}
    - --service={{ .service }}
    - --tls-ca={{ .root.Values.tls.mountPath }}/ca.crt
    - --tls-cert={{ .root.Values.tls.mountPath }}/tls.crt
    - --tls-key={{ .root.Values.tls.mountPath }}/tls.key
    - --tls-server-name={{ .serverName }}
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}
