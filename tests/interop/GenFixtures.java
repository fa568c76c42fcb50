// Generates the interop fixtures in tests/interop/fixtures/ with Apache Avro Java
// (org.apache.avro.message.BinaryMessageEncoder), an Avro implementation this project did
// not write.  See tests/interop/README.md for the exact command; gen_fixtures.sh runs it.
//
// For each fixture it writes
//   <name>.avro-so  the single-object encoding exactly as BinaryMessageEncoder returned it
//   <name>.json     the schema file, the 8 fingerprint bytes, the datum (bytes fields as hex)
// and checks that BinaryMessageDecoder reads the bytes back to an equal datum.
//
// Usage: java -cp <avro jars> GenFixtures.java <schemas dir> <out dir>

import java.io.File;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.avro.util.Utf8;
import org.codehaus.jackson.map.ObjectMapper;

public class GenFixtures {
    static File schemasDir;
    static File outDir;
    static final ObjectMapper JSON = new ObjectMapper();

    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: GenFixtures <schemas dir> <out dir>");
            System.exit(2);
        }
        schemasDir = new File(args[0]);
        outDir = new File(args[1]);
        outDir.mkdirs();

        // SPEC 4.1 vector: the schema "null" and the null datum (empty body).
        Schema nullSchema = Schema.create(Schema.Type.NULL);
        byte[] fp = SchemaNormalization.parsingFingerprint("CRC-64-AVRO", nullSchema);
        System.out.println("SchemaNormalization.parsingFingerprint(CRC-64-AVRO, \"null\") = " + hex(fp)
                + "  parsingFingerprint64 = 0x" + Long.toHexString(SchemaNormalization.parsingFingerprint64(nullSchema)).toUpperCase());
        write("null", null, nullSchema, null, new LinkedHashMap<String, Object>());

        // 1. execution_opened (ExecutionOpened v1): one union on its null branch (origin).
        Schema opened = load("ExecutionOpened.v1.avsc");
        GenericRecord eo = new GenericData.Record(opened);
        eo.put("event_id", "execution_opened/exec-interop-0001");
        eo.put("event_type", "execution_opened");
        eo.put("occurred_at", 1744297104000000L);  // 2025-04-10T14:58:24Z (timestamp-micros)
        eo.put("producer", "ledger-ingest");
        eo.put("stamped", Arrays.asList("producer", "event_id"));
        eo.put("execution_id", "exec-interop-0001");
        eo.put("task_id", "task-interop-0001");
        eo.put("deadline", 1744311504000000L);  // 2025-04-10T18:58:24Z
        eo.put("policy", "qwen3.6-35b-a3b-coder@rl-step-1200");
        eo.put("tokenizer", "Qwen3.6");
        eo.put("origin", null);
        eo.put("collection_run_id", "run-internal-bugbash-16");
        eo.put("metadata", "{\"harness\":\"ledger.workload\",\"repo\":\"ledgerline\",\"seed\":7000021}");
        write("execution_opened", "ExecutionOpened.v1.avsc", opened, eo, new LinkedHashMap<String, Object>());

        // 2. request (RequestRecorded v2) with packed token ids (LE uint32) and logprobs (LE float32).
        Schema request = load("RequestRecorded.v2.avsc");
        int[] inputIds = {248045, 8678, 198, 2523, 513, 2441, 895, 11, 449, 14791, 248046, 198};
        int[] outputIds = {248068, 198, 9764, 728, 1151, 539, 248069, 0, 0xFFFFFFFF};  // 0 and 2**32-1: the uint32 range ends
        float[] logprobs = {-0.0032f, -0.46429f, -0.00605f, -0.00785f, -5.4293f, -0.00869f, -1.0e-5f, 0.0f, -17.25f};
        GenericRecord rq = new GenericData.Record(request);
        rq.put("event_id", "request/exec-interop-0001/r001");
        rq.put("event_type", "request");
        rq.put("occurred_at", 1744297105464732L);
        rq.put("producer", "ledger-ingest");
        rq.put("stamped", Arrays.asList("producer", "event_id"));
        rq.put("execution_id", "exec-interop-0001");
        rq.put("request_id", "r001");
        rq.put("input_ids", ByteBuffer.wrap(u32(inputIds)));
        rq.put("input_prefix", null);
        rq.put("input_suffix_ids", null);
        rq.put("output_ids", ByteBuffer.wrap(u32(outputIds)));
        rq.put("output_logprobs", ByteBuffer.wrap(f32(logprobs)));
        rq.put("agent_id", "main");
        rq.put("agent_tier", "main");
        rq.put("turn_kind", "task");
        rq.put("generator", "policy");
        rq.put("parent_request_id", null);
        rq.put("consumed_tool_call_ids", Collections.emptyList());
        rq.put("emitted_tool_call_ids", Arrays.asList("call_6a0d0d2cfad879af"));
        rq.put("reconstructed", false);
        rq.put("model", "Qwen/Qwen3.6-35B-A3B");
        rq.put("finish_reason", "tool_calls");
        rq.put("sealed", null);
        Map<String, Object> unpacked = new LinkedHashMap<>();
        unpacked.put("input_ids", u32List(inputIds));
        unpacked.put("output_ids", u32List(outputIds));
        unpacked.put("output_logprobs", f32List(logprobs));
        write("request", "RequestRecorded.v2.avsc", request, rq, unpacked);

        // 3. request (RequestRecorded v2) by prefix reference: a record-typed union branch.
        GenericRecord rp = new GenericData.Record(request);
        Schema prefixSchema = request.getField("input_prefix").schema().getTypes().get(1);
        GenericRecord prefix = new GenericData.Record(prefixSchema);
        prefix.put("request_id", "r001");
        prefix.put("length", 21L);
        prefix.put("sha256", "a531182382fa535cd2122a5ed890f9819d19d2eb2ed3cfef05763d50f507cb9a");
        int[] suffixIds = {198, 248045, 846, 198};
        int[] outputIds2 = {248068, 198, 11280, 3425, 248046};
        rp.put("event_id", "request/exec-interop-0001/r002");
        rp.put("event_type", "request");
        rp.put("occurred_at", 1744297108572756L);
        rp.put("producer", "ledger-ingest");
        rp.put("stamped", Arrays.asList("producer", "event_id"));
        rp.put("execution_id", "exec-interop-0001");
        rp.put("request_id", "r002");
        rp.put("input_ids", null);
        rp.put("input_prefix", prefix);
        rp.put("input_suffix_ids", ByteBuffer.wrap(u32(suffixIds)));
        rp.put("output_ids", ByteBuffer.wrap(u32(outputIds2)));
        rp.put("output_logprobs", null);
        rp.put("agent_id", "main");
        rp.put("agent_tier", "main");
        rp.put("turn_kind", "task");
        rp.put("generator", "policy");
        rp.put("parent_request_id", "r001");
        rp.put("consumed_tool_call_ids", Arrays.asList("call_6a0d0d2cfad879af"));
        rp.put("emitted_tool_call_ids", Arrays.asList("call_4331d15f31b4a1cd", "call_71eb45d745fd70fc"));
        rp.put("reconstructed", false);
        rp.put("model", "Qwen/Qwen3.6-35B-A3B");
        rp.put("finish_reason", "tool_calls");
        rp.put("sealed", null);
        Map<String, Object> unpacked2 = new LinkedHashMap<>();
        unpacked2.put("input_suffix_ids", u32List(suffixIds));
        unpacked2.put("output_ids", u32List(outputIds2));
        write("request_prefix", "RequestRecorded.v2.avsc", request, rp, unpacked2);

        // 4. tool_payload (ToolPayloadCached v1): canonical-JSON payload with non-ASCII text.
        Schema tool = load("ToolPayloadCached.v1.avsc");
        GenericRecord tp = new GenericData.Record(tool);
        tp.put("event_id", "tool_payload/exec-interop-0001/call_6a0d0d2cfad879af");
        tp.put("event_type", "tool_payload");
        tp.put("occurred_at", 1744297105514732L);
        tp.put("producer", "ledger-ingest");
        tp.put("stamped", Arrays.asList("producer", "event_id"));
        tp.put("execution_id", "exec-interop-0001");
        tp.put("call_id", "call_6a0d0d2cfad879af");
        tp.put("kind", "call");
        tp.put("payload", "{\"arguments\":{\"pattern\":\"caf\u00e9 \u2192 \u65e5\u672c \ud83d\ude80\"},\"name\":\"grep\"}");
        write("tool_payload", "ToolPayloadCached.v1.avsc", tool, tp, new LinkedHashMap<String, Object>());

        // 5. cost_recorded written with the OLD schema (CostRecorded v1, amount only): a reader
        //    on CostRecorded v2 must fill category=null and currency="USD" from the defaults.
        Schema cost1 = load("CostRecorded.v1.avsc");
        GenericRecord c1 = new GenericData.Record(cost1);
        c1.put("event_id", "cost_recorded/exec-interop-0001/gpu");
        c1.put("event_type", "cost_recorded");
        c1.put("occurred_at", 1744300000123456L);
        c1.put("producer", "billing-exporter");
        c1.put("stamped", Collections.emptyList());
        c1.put("execution_id", "exec-interop-0001");
        c1.put("amount", 0.0123);
        write("cost_recorded_v1", "CostRecorded.v1.avsc", cost1, c1, new LinkedHashMap<String, Object>());
    }

    static Schema load(String file) throws Exception {
        return new Schema.Parser().parse(new File(schemasDir, file));
    }

    static void write(String name, String schemaFile, Schema schema, GenericRecord datum,
                      Map<String, Object> unpacked) throws Exception {
        BinaryMessageEncoder<Object> enc = new BinaryMessageEncoder<>(GenericData.get(), schema);
        ByteBuffer buf = enc.encode(datum);
        byte[] bytes = new byte[buf.remaining()];
        buf.get(bytes);

        // self-check with Avro's own decoder
        BinaryMessageDecoder<Object> dec = new BinaryMessageDecoder<>(GenericData.get(), schema);
        Object back = dec.decode(bytes);
        if (!(datum == null ? back == null : GenericData.get().compare(datum, back, schema) == 0)) {
            throw new IllegalStateException(name + ": BinaryMessageDecoder did not read back the datum: " + back);
        }

        byte[] fp = SchemaNormalization.parsingFingerprint("CRC-64-AVRO", schema);
        Map<String, Object> doc = new LinkedHashMap<>();
        doc.put("schema", schemaFile == null ? "\"null\"" : schemaFile);
        doc.put("record", schema.getType() == Schema.Type.RECORD ? schema.getFullName() : null);
        doc.put("fingerprint", hex(fp));
        doc.put("parsing_canonical_form", SchemaNormalization.toParsingForm(schema));
        doc.put("produced_by", "Apache Avro Java " + org.apache.avro.Schema.class.getPackage().getImplementationVersion()
                + " org.apache.avro.message.BinaryMessageEncoder, GenericData");
        doc.put("length", bytes.length);
        doc.put("encoded", hex(bytes));
        List<String> bytesFields = new ArrayList<>();
        doc.put("datum", toJson(datum, schema, "", bytesFields));
        doc.put("bytes_fields", bytesFields);
        doc.put("unpacked", unpacked);
        Files.write(new File(outDir, name + ".avro-so").toPath(), bytes);
        JSON.writerWithDefaultPrettyPrinter().writeValue(new File(outDir, name + ".json"), doc);
        System.out.println(name + ".avro-so  " + bytes.length + " bytes  header " + hex(Arrays.copyOf(bytes, Math.min(10, bytes.length))));
    }

    /** The datum as plain JSON: records as objects, bytes as lowercase hex, timestamps as int micros. */
    static Object toJson(Object v, Schema s, String path, List<String> bytesFields) {
        switch (s.getType()) {
            case NULL:
                return null;
            case UNION:
                int i = GenericData.get().resolveUnion(s, v);
                return toJson(v, s.getTypes().get(i), path, bytesFields);
            case RECORD: {
                GenericRecord r = (GenericRecord) v;
                Map<String, Object> m = new LinkedHashMap<>();
                for (Schema.Field f : s.getFields()) {
                    String p = path.isEmpty() ? f.name() : path + "." + f.name();
                    m.put(f.name(), toJson(r.get(f.name()), f.schema(), p, bytesFields));
                }
                return m;
            }
            case ARRAY: {
                List<Object> out = new ArrayList<>();
                for (Object o : (Iterable<?>) v) out.add(toJson(o, s.getElementType(), path + "[]", bytesFields));
                return out;
            }
            case BYTES: {
                if (!bytesFields.contains(path)) bytesFields.add(path);
                ByteBuffer b = ((ByteBuffer) v).duplicate();
                byte[] a = new byte[b.remaining()];
                b.get(a);
                return hex(a);
            }
            case STRING:
                return v instanceof Utf8 ? v.toString() : (String) v;
            default:
                return v;  // long, double, boolean
        }
    }

    static byte[] u32(int[] ids) {
        ByteBuffer b = ByteBuffer.allocate(4 * ids.length).order(ByteOrder.LITTLE_ENDIAN);
        for (int id : ids) b.putInt(id);
        return b.array();
    }

    static byte[] f32(float[] xs) {
        ByteBuffer b = ByteBuffer.allocate(4 * xs.length).order(ByteOrder.LITTLE_ENDIAN);
        for (float x : xs) b.putFloat(x);
        return b.array();
    }

    static List<Long> u32List(int[] ids) {
        List<Long> out = new ArrayList<>();
        for (int id : ids) out.add(id & 0xFFFFFFFFL);
        return out;
    }

    static List<Double> f32List(float[] xs) {
        List<Double> out = new ArrayList<>();
        for (float x : xs) out.add((double) x);  // the exact float32 value, widened
        return out;
    }

    static String hex(byte[] a) {
        StringBuilder sb = new StringBuilder();
        for (byte x : a) sb.append(String.format("%02x", x & 0xFF));
        return sb.toString();
    }
}
